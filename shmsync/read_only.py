"""Parameters that view a store's read-only shared memory (zero-copy readers).

A write to such a parameter would fault (SIGSEGV): the memory is mapped read-only so that no
worker can corrupt the weights every other worker runs. So that the usual way to write them,
an optimizer step, fails as a Python error instead, viewing parameters stop requiring gradients
and a global optimizer step pre-hook refuses any optimizer that holds one.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# id(parameter) -> (the parameter, its name, the store's name, its requires_grad before).
_VIEWING: dict[int, tuple[weakref.ref, str, str, bool]] = {}
# Re-entrant: a zero-copy reader's finalizer unmarks its parameters, and garbage collection can
# run it on a thread that is inside mark() or unmark() (any allocation can collect).
_LOCK = threading.RLock()
_HOOKED = False


def mark(params: list[torch.Tensor], names: list[str], store: str) -> None:
    """Record ``params`` as viewing ``store`` and stop them requiring gradients."""
    global _HOOKED
    with _LOCK:
        for p, name in zip(params, names):
            if id(p) not in _VIEWING:
                _VIEWING[id(p)] = (weakref.ref(p), name, store, p.requires_grad)
            p.requires_grad_(False)
        if not _HOOKED:
            register_optimizer_step_pre_hook(_refuse_viewing)
            _HOOKED = True


def unmark(params: list[torch.Tensor]) -> None:
    """``params`` hold private memory again: they require gradients as they did before."""
    with _LOCK:
        for p in params:
            entry = _VIEWING.pop(id(p), None)
            if entry is not None and entry[0]() is p:
                p.requires_grad_(entry[3])


def _refuse_viewing(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if not _VIEWING:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _VIEWING.get(id(p))
            if entry is not None and entry[0]() is p:
                raise RuntimeError(
                    f"parameter {entry[1]!r} views the read-only shared memory of store {entry[2]!r} "
                    "(a zero_copy reader): an optimizer step would write to it. Train a module of its own "
                    "(the trainer's), or read this store with zero_copy=False"
                )
