"""Worker side of :class:`~shmsync.ShmWeightSyncScheme`: a reader per key, checked at every policy call.

Two mechanisms load new versions, each enough on its own, so that no single TorchRL call path
carries the guarantee:

- the policy's own **forward pre-hook** checks the version (one load of a shared word when nothing changed) and
  reloads when it changed: whatever path TorchRL takes to run the policy, its next call finds
  the newest version. With ``poll_every_steps=N`` it checks every N-th call inside a rollout
  shmsync saw begin, and at every call outside one (a rollout TorchRL started another way);
- the worker's collector's **rollout** is shadowed by an instance attribute that polls before
  each rollout (so a batch runs one version whenever the trainer published between batches),
  and after it tags ``("next", key)``, and tags the frames itself if the policy's hooks did not
  run. Not a ``pre_collect_hook``: users may assign theirs after construction.

Frames are tagged with the version loaded when they were produced. Once every worker has
attached to the store, the last one to do so removes its name from the host: from then on the
store lives exactly as long as the processes mapping it, whatever kills them.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from tensordict import TensorDictBase
from torch import nn

from shmsync.reader.reader import WeightReader
from shmsync.torchrl import compat
from shmsync.watch.frames import tag_all, tag_next, tag_versions
from shmsync.writer.store import WeightStore


class Receiver:
    """The reader for one key in one worker, bound to whatever model the scheme points at.

    Args:
        scheme: the worker's copy of the scheme.
        store_name: the store to attach to.
        expected_readers: readers that attach to this store in all (every worker, every key);
            the last of them removes the store's name from the host.
    """

    def __init__(self, scheme: Any, store_name: str, expected_readers: int | None = None) -> None:
        self.scheme = scheme
        self.runs_sent_weights_next = scheme.runs_sent_weights_next  # wait for what the trainer promised
        self.store = WeightStore.attach(store_name)
        self.reader: WeightReader | None = None
        self.token = secrets.token_hex(4)
        self.calls = 0
        self.hooked_calls = 0  # policy calls seen by the forward hooks (the rollout wrapper checks)
        self.in_rollout = False  # inside a rollout that shmsync's shadow saw begin
        self.expected_readers = expected_readers
        self.collector: Any = None  # the worker's own collector, once TorchRL hands it over
        self.waiting = False  # between rollouts of a collector whose rollouts shmsync sees

    @property
    def version(self) -> int:
        return self.reader.version if self.reader is not None else -1

    def current(self) -> WeightReader:
        model = self.scheme.model
        if self.reader is None or self.reader.module is not model:
            # The collector may replace the policy (say, a copy moved to its device).
            first = self.reader is None
            self.reader = WeightReader(
                self.store,
                model,
                destination=self.scheme.model_id,
                zero_copy=self.scheme.settings.zero_copy,
                worker=self.scheme.worker_idx,
                keep_writes=True,  # TorchRL's load_state_dict writes the policy's weights
            )
            self.reader.set_waiting(self.waiting)
            self._install_hooks(model)
            if first:
                self._unlink_once_all_attached()
        return self.reader

    def _unlink_once_all_attached(self) -> None:
        expected = self.expected_readers
        if expected is not None and len(self.store.readers(processes=False)) >= expected:
            self.store.unlink()  # every reader holds its mapping: the name is no longer needed

    def poll(self) -> bool:
        """Load the newest version; in a worker of a collector whose next batch runs the weights
        just sent (``MultiSyncCollector``), wait for a version the trainer promised to land."""
        if self.collector is None and self.scheme.context is not None:
            self.bind(self.scheme.context)  # TorchRL handed the worker's collector over since
        reader = self.current()
        reloaded = reader.poll_promised(reader.timeout) if self.runs_sent_weights_next else reader.poll()
        if reloaded and self.collector is not None:
            # The first load may come while the worker's collector is still being built.
            compat.set_policy_version(self.collector, self.version, built=False)
        return reloaded

    def bind(self, collector: Any) -> None:
        """Poll before every rollout of ``collector`` (this worker's own collector)."""
        if collector is None or self.collector is collector:
            return
        self.collector = collector
        rollout = compat.shadowed_rollout(collector)
        if not isinstance(rollout, PollingRollout):
            original = compat.worker_rollout(collector)
            if original is None:
                return  # no rollout to shadow: the policy's hook checks at every call
            rollout = PollingRollout(original)
            compat.shadow_rollout(collector, rollout)
        rollout.add(self)
        self.set_waiting(True)  # until its first rollout: the collector waits for the trainer's word

    def set_waiting(self, waiting: bool) -> None:
        """Tell the readers' table whether this worker is between rollouts."""
        self.waiting = waiting
        if self.reader is not None:
            self.reader.set_waiting(waiting)

    def set_in_rollout(self, in_rollout: bool) -> None:
        """A rollout that shmsync's shadow saw begin (the policy's hook then checks the version at
        every ``poll_every_steps``-th call), or its end (the worker waits, as the table says)."""
        self.in_rollout = in_rollout
        # At a rollout's start, after its poll: never seen running with the old version.
        self.set_waiting(not in_rollout)

    def _install_hooks(self, model: nn.Module) -> None:
        if getattr(model, "_shmsync_hooks", None) == self.token:
            return  # copied along with the module: the closures already point here
        # A plain attribute, so deep copies of the module keep it (torch types Module attributes as
        # tensors or modules only).
        model._shmsync_hooks = self.token  # type: ignore[assignment]
        # state_dict() of the worker's policy shows the newest published weights.
        model.register_state_dict_pre_hook(_state_dict_pre_hook(self))
        # First among the pre-hooks: it loads what the reader's not-loaded guard would refuse to run.
        model.register_forward_pre_hook(_step_poll_hook(self, self.scheme.settings.poll_every_steps), prepend=True)
        if self.scheme.settings.version_key is not None:
            tag_versions(model, lambda: self.version, self.scheme.settings.version_key)

    def close(self) -> None:
        rollout = compat.shadowed_rollout(self.collector) if self.collector is not None else None
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
        first = receivers[0] if receivers else None
        if first is not None:
            # Also after a load_state_dict() that restored another number with no reload.
            compat.set_policy_version(first.collector, first.version)
        hooked, version = (first.hooked_calls, first.version) if first is not None else (0, -1)
        for receiver in receivers:
            receiver.set_in_rollout(True)
        try:
            batch = self.rollout(*args, **kwargs)
        finally:
            for receiver in receivers:
                receiver.set_in_rollout(False)
        key = first.scheme.settings.version_key if first is not None else None
        if first is not None and key is not None and isinstance(batch, TensorDictBase):
            if first.hooked_calls == hooked:
                # The policy ran without its hooks (TorchRL called it another way): nothing
                # reloaded during the rollout, so every frame ran the version polled above.
                tag_all(batch, key, version)
            tag_next(batch, key)
        return batch


# Hooks are closures, not bound methods: deep-copying a module copies its hooks, and a
# copied bound method would copy the receiver (and its mapping) with it.
def _state_dict_pre_hook(receiver: Receiver) -> Callable:
    def hook(module, _prefix, _keep_vars):
        receiver.poll()

    return hook


def _step_poll_hook(receiver: Receiver, every: int | None) -> Callable:
    """Checks the version at every policy call (every ``every``-th inside a rollout shmsync saw
    begin, if given) and reloads when it changed: whatever path TorchRL takes to a rollout, its
    next step runs the newest version."""

    def hook(module, args):
        receiver.calls += 1
        receiver.hooked_calls += 1
        if every is None or not receiver.in_rollout or receiver.calls % every == 0:
            reader = receiver.reader
            # Nothing new for the module this reader loads: one look at two shared words.
            if reader is None or reader.module is not module or not reader.up_to_date():
                receiver.poll()

    return hook
