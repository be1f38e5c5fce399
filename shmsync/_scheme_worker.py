"""Worker side of :class:`~shmsync.ShmWeightSyncScheme`: a reader per key, polled before each rollout.

The poll is not a ``pre_collect_hook``: TorchRL lets users assign those after construction,
which would silently remove it. Instead each worker's own collector gets its ``rollout``
shadowed by an instance attribute that polls, runs the rollout, then copies the version tag
to ``("next", key)``. Until a collector is bound (or if none ever is), the policy polls
before every call, so no path runs stale weights unnoticed.
"""

from __future__ import annotations

import secrets
import sys
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from .reader import WeightReader
from .store import WeightStore
from .tagging import tag_versions, warn_clash


class Receiver:
    """The reader for one key in one worker, bound to whatever model the scheme points at."""

    def __init__(self, scheme: Any, store_name: str) -> None:
        self.scheme = scheme
        self.store = WeightStore.attach(store_name)
        self.reader: WeightReader | None = None
        self.token = secrets.token_hex(4)
        self.calls = 0
        self.collector: Any = None  # the worker's own collector, once TorchRL hands it over

    @property
    def version(self) -> int:
        return self.reader.version if self.reader is not None else -1

    def current(self) -> WeightReader:
        model = self.scheme.model
        if self.reader is None or self.reader.module is not model:
            # The collector may replace the policy (say, a copy moved to its device).
            on_gpu = any(t.is_cuda for t in (*model.parameters(), *model.buffers()))
            self.reader = WeightReader(
                self.store, model, destination=self.scheme.model_id, zero_copy=self.scheme.zero_copy and not on_gpu
            )
            self._install_hooks(model)
        return self.reader

    def poll(self) -> bool:
        reloaded = self.current().poll()
        if reloaded and self.collector is not None:
            sync_tracker(self.collector, self.version)
        return reloaded

    def bind(self, collector: Any) -> None:
        """Poll before every rollout of ``collector`` (this worker's own collector)."""
        if collector is None or self.collector is collector:
            return
        self.collector = collector
        rollout = collector.__dict__.get("rollout")
        if not isinstance(rollout, PollingRollout):
            rollout = PollingRollout(collector.rollout)
            collector.__dict__["rollout"] = rollout  # an instance attribute shadows the method
        rollout.add(self)

    def _install_hooks(self, model: nn.Module) -> None:
        if getattr(model, "_shmsync_hooks", None) == self.token:
            return  # copied along with the module: the closures already point here
        model.__dict__["_shmsync_hooks"] = self.token
        # state_dict() of the worker's policy shows the newest published weights.
        model.register_state_dict_pre_hook(_state_dict_pre_hook(self))
        model.register_forward_pre_hook(_step_poll_hook(self, self.scheme.poll_every_steps))
        if self.scheme.version_key is not None:
            tag_versions(model, lambda: self.version, self.scheme.version_key)

    def close(self) -> None:
        rollout = self.collector.__dict__.get("rollout") if self.collector is not None else None
        if isinstance(rollout, PollingRollout):
            rollout.discard(self)
        self.collector = None
        self.store.close()


class PollingRollout:
    """Stands in for a worker collector's ``rollout``: poll, roll out, tag ``("next", key)``."""

    def __init__(self, rollout: Callable[[], Any]) -> None:
        self.rollout = rollout
        self.receivers: list[Receiver] = []

    def add(self, receiver: Receiver) -> None:
        if receiver not in self.receivers:
            self.receivers.append(receiver)
            # The policy's receiver names the version: it is the one the frames are tagged with.
            self.receivers.sort(key=lambda r: r.scheme.model_id != "policy")

    def discard(self, receiver: Receiver) -> None:
        if receiver in self.receivers:
            self.receivers.remove(receiver)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        receivers = self.receivers
        for receiver in receivers:
            receiver.poll()
        if receivers:
            # Also after a load_state_dict() that restored another number with no reload.
            sync_tracker(receivers[0].collector, receivers[0].version)
        batch = self.rollout(*args, **kwargs)
        key = receivers[0].scheme.version_key if receivers else None
        if key is not None and isinstance(batch, TensorDictBase):
            tag_next(batch, key)
        return batch


def sync_tracker(collector: Any, version: int) -> None:
    """Make TorchRL's ``track_policy_version`` tracker report ``version``: in a worker the version
    it loaded, in the trainer the last one published."""
    tracker = getattr(collector, "policy_version_tracker", None)
    if tracker is not None and getattr(tracker, "version", version) != version:
        tracker.version = version


def find_worker_collector(depth: int = 12) -> Any:
    """The worker's own collector, found on the call stack of the receiver's first load.

    torchrl 0.12 initializes the receiver while the worker's collector builds its policy and
    never hands the collector over (0.13 and later set the scheme's ``context``); that
    collector's ``__init__`` is then among the callers.
    """
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if callable(getattr(owner, "rollout", None)) and callable(getattr(owner, "iterator", None)):
            return owner
        frame = frame.f_back
    return None


def tag_next(batch: TensorDictBase, key: str) -> None:
    """Copy the frames' version tag to ``("next", key)``, in place where it exists."""
    if key not in batch.keys():
        return
    root, nxt = batch.get(key), batch.get(("next", key), None)
    if root.dtype != torch.int64:
        return  # not shmsync's tag (the policy hook warned)
    if nxt is not None and nxt.dtype != torch.int64:
        warn_clash(f"('next', {key!r})", nxt.dtype)
        return
    if nxt is not None and nxt.shape == root.shape:
        nxt.copy_(root)  # in place: the batch may live in buffers shared with the trainer
    elif "next" in batch.keys():
        batch.set(("next", key), root.clone())


# Hooks are closures, not bound methods: deep-copying a module copies its hooks, and a
# copied bound method would copy the receiver (and its mapping) with it.
def _state_dict_pre_hook(receiver: Receiver) -> Callable:
    def hook(module, prefix, keep_vars):
        receiver.poll()

    return hook


def _step_poll_hook(receiver: Receiver, every: int | None) -> Callable:
    def hook(module, args):
        receiver.calls += 1
        if receiver.collector is None or (every is not None and receiver.calls % every == 0):
            receiver.poll()

    return hook
