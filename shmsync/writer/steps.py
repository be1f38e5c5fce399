"""How much training each version had seen: the optimizer steps this process took on a store's
weights, counted as they happen and recorded with each version published.

An optimizer step counts for a store when the optimizer holds any of the tensors last published
into it, found by their memory (a loss module's copy of a parameter that shares its storage counts
too): in SAC or TD3, the actor's optimizer steps count for the policy's store, the critics' do
not. One process-wide hook of torch's (``register_optimizer_step_post_hook``) sees every step; it
is registered when the first store counts, and costs a set lookup per parameter of the stepping
optimizer while a store counts.

The count goes into the store's header (``W_STEPS``); each write reads it when it begins, and its
commit records it with the version, in the header's steps ring and in the writer's own record of
recent versions (:mod:`shmsync.core.protocol`): a batch's frames carry a version, and the
trainer's count now minus that version's count is how many optimizer steps behind its weights were.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from shmsync.core.header import W_STEPS

_COUNTERS: weakref.WeakSet = weakref.WeakSet()  # every counting store's counter in this process
_HOOKED = False
_LOCK = threading.Lock()  # optimizers may step on several threads


class OptimizerSteps:
    """The optimizer steps taken on one store's weights in this process, counted into the store's
    header, where each write the store begins reads the count (see :class:`~shmsync.core.protocol.Write`).

    Args:
        header: the store's header words.

    Attributes:
        tensors: the tensors last published: the steps of optimizers holding any of them count
            (set by the writer at each publish; where they start in memory is worked out at the
            next step, and again only when another list is set).

    Examples:
        >>> import torch
        >>> from shmsync.core.header import W_STEPS
        >>> policy = torch.nn.Linear(2, 1)
        >>> header = [-1] * 64
        >>> steps = OptimizerSteps(header)
        >>> steps.start()
        >>> steps.tensors = list(policy.parameters())
        >>> optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
        >>> policy(torch.ones(1, 2)).sum().backward()
        >>> optimizer.step()
        >>> header[W_STEPS]
        1
    """

    def __init__(self, header) -> None:
        self.header = header
        self.count = 0
        self.tensors: list[torch.Tensor] = []
        self._seen: list[torch.Tensor] | None = None
        self._memory: frozenset[int] = frozenset()  # where the watched tensors' data starts

    def start(self) -> None:
        """Count from now on (this process took the writer role), on from the store's count."""
        if self not in _COUNTERS:
            self.header[W_STEPS] = self.count = max(0, self.header[W_STEPS])  # a later writer counts on
            _start_counting(self)

    def stepped(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer`` took a step: count it if it holds a tensor last published."""
        if self.tensors is not self._seen:
            self._seen = self.tensors
            self._memory = frozenset(t.data_ptr() for t in self.tensors if not t.is_meta)
        memory = self._memory
        if memory and any(p.data_ptr() in memory for group in optimizer.param_groups for p in group["params"]):
            self.count += 1
            try:
                self.header[W_STEPS] = self.count
            except ValueError:  # the store was closed here: nothing to count for any more
                self.close()

    def close(self) -> None:
        """Count no more."""
        _COUNTERS.discard(self)


def _start_counting(counter: OptimizerSteps) -> None:
    global _HOOKED
    with _LOCK:
        _COUNTERS.add(counter)
        if not _HOOKED:
            _HOOKED = True
            register_optimizer_step_post_hook(_count_step)


def _count_step(optimizer: torch.optim.Optimizer, _args, _kwargs) -> None:
    if _COUNTERS:
        with _LOCK:
            for counter in list(_COUNTERS):
                counter.stepped(optimizer)
