"""Weights whose values tell which version a reader holds: modules of plain buffers or parameters,
filled with a version's number, so that one complete version holds one value and a mix shows."""

from __future__ import annotations

import torch
from tensordict import TensorDict
from torch import nn

SMALL = {"a": 1000, "b": 300, "c": 7}

STRESS_SIZES = {"a": 2_000_000, "b": 1_000_000, "c": 1_000_000, "d": 17}  # ~16 MB of float32


class Blob(nn.Module):
    """A module whose buffers match :func:`blob_weights` (for stress tests)."""

    def __init__(self, sizes: dict[str, int], dtype=torch.float32):
        super().__init__()
        for k, n in sizes.items():
            self.register_buffer(k, torch.zeros(n, dtype=dtype))


class ParamBlob(nn.Module):
    """Like :class:`Blob`, with parameters (what a reader in place points at shared memory)."""

    def __init__(self, sizes: dict[str, int]):
        super().__init__()
        for k, n in sizes.items():
            self.register_parameter(k, nn.Parameter(torch.zeros(n)))


def blob_weights(sizes: dict[str, int], value: float = 0.0) -> TensorDict:
    return TensorDict({k: torch.full((n,), float(value)) for k, n in sizes.items()})


def set_all(td: TensorDict, value: float) -> None:
    for t in td.values():
        t.fill_(value)


def fill(module: nn.Module, value: float) -> None:
    """Every parameter of ``module`` set to ``value`` in place."""
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(value)


def mixed_values(module: nn.Module) -> set[float]:
    """Distinct values across all parameters and buffers (one value means one consistent version)."""
    vals = set()
    for b in (*module.parameters(), *module.buffers()):
        lo, hi = torch.aminmax(b.detach())
        vals.update({float(lo), float(hi)})
    return vals


def store_state(store):
    """A store's version and a private copy of its weights, to compare with later."""
    snap = store.snapshot()
    return store.version, snap.weights.clone()


def assert_unchanged(store, before):
    """The store holds what :func:`store_state` recorded: nothing was written."""
    version, weights = before
    assert store.version == version
    after = store.snapshot()
    assert after.version == version
    assert (after.weights == weights).all()
