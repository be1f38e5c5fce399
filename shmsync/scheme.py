"""``ShmWeightSyncScheme``: TorchRL's multi-process collectors on a shmsync store.

Sender (main process): the collector's models for every key that uses this scheme go
into one :class:`~shmsync.WeightStore`; ``update_policy_weights_()`` publishes into it
and returns, with no message to and no acknowledgement from any worker. All keys sent
by one ``update_policy_weights_`` call are published together as one version.

Receiver (each worker): attaches, loads the first weights into the (meta-device) policy,
then checks the version at the start of every rollout (and, optionally, every N policy
calls) and reloads only when it changed. Each frame is tagged with the version of the
weights that produced it.
"""

from __future__ import annotations

import functools
import secrets
import weakref
from collections.abc import Callable
from typing import Any

from tensordict import TensorDict, TensorDictBase
from torch import nn
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme

from .reader import WeightReader
from .store import WeightStore
from .tagging import tag_versions

# Worker process: store name -> receivers polled before each rollout.
_RECEIVERS: dict[str, list[_Receiver]] = {}


class ShmWeightSyncScheme(WeightSyncScheme):
    """Weight sync for ``MultiSyncCollector`` / ``MultiAsyncCollector`` through shared memory.

    Workers never see half-written weights (each reload is one complete version), the
    trainer never waits for workers, and each worker's weights are a private copy: an
    in-place edit of the trainer's parameters reaches no worker until it is published.

    Args:
        poll_every_steps: also check for new weights every this many policy calls inside a
            rollout (for long rollouts). Default: only at the start of each rollout.
        version_key: the key under which every collected frame records the version of the
            weights that produced it (also written under ``("next", version_key)``); None
            to write nothing.
        num_slots: copies kept in shared memory (see :meth:`WeightStore.create`). Default:
            3, or 4 with ``zero_copy`` (so that every worker of a ``MultiSyncCollector``
            can lease; a ``MultiAsyncCollector`` needs ``workers + 2`` for all of them to).
        zero_copy: CPU workers point their policy's parameters at the store's read-only
            shared memory instead of copying on each reload (see
            :class:`~shmsync.WeightReader`): no copy and no private copy of the weights per
            worker. Workers on a GPU copy as always. The policy must not write its own
            parameters in place in the worker.
        source: the trainer-side module for this key, when the collector cannot resolve it in
            the main process (say, a key such as ``"env.transform[0]"`` that names a module
            that exists only inside each worker). Default: ``collector.get_model(key)``.

    Examples:
        >>> from torchrl.collectors import MultiSyncCollector  # doctest: +SKIP
        >>> collector = MultiSyncCollector(
        ...     [make_env] * 2, policy, frames_per_batch=200, total_frames=-1,
        ...     weight_sync_schemes={"policy": ShmWeightSyncScheme()},
        ... )  # doctest: +SKIP
        >>> for batch in collector:  # doctest: +SKIP
        ...     train_on(batch)
        ...     collector.update_policy_weights_()  # publish: returns at once
    """

    def __init__(
        self,
        *,
        poll_every_steps: int | None = None,
        version_key: str | None = "policy_version",
        num_slots: int | None = None,
        zero_copy: bool = False,
        source: nn.Module | None = None,
        strategy: str = "tensordict",
    ) -> None:
        super().__init__(strategy)
        if source is not None and not isinstance(source, nn.Module):
            raise TypeError(f"source must be an nn.Module, got {type(source).__name__}")
        self.source = source
        if poll_every_steps is not None and poll_every_steps < 1:
            raise ValueError(f"poll_every_steps must be >= 1 or None, got {poll_every_steps}")
        self.poll_every_steps = poll_every_steps
        self.version_key = version_key
        self.zero_copy = zero_copy
        self.num_slots = num_slots if num_slots is not None else 4 if zero_copy else 3
        self._store_name: str | None = None
        self._group: _SenderGroup | None = None
        self._receiver: _Receiver | None = None

    # -- sender ---------------------------------------------------------------------------------
    def _init_on_sender_impl(
        self, model_id: str, context: Any = None, ctx: Any = None, model: Any = None, **kwargs: Any
    ) -> None:
        self.model_id = model_id
        if context is not None:
            self.context = context
        if model is not None:
            self.model = model
        self._group = _SenderGroup.join(self, context)
        self._store_name = self._group.store.name

    def _setup_connection_and_weights_on_sender_impl(self, *, worker_idx: int | None = None, weights: Any = None):
        # The store already holds the initial weights: workers load them on their own.
        if weights is not None:
            self.send(weights)

    def send(self, weights: Any = None, worker_ids: Any = None) -> None:
        """Publish ``weights`` (default: the collector's model) for this key.

        Returns as soon as the store holds the new version; ``worker_ids`` is accepted for
        compatibility and ignored: every worker loads the newest version.
        """
        if self._group is None:
            raise RuntimeError("ShmWeightSyncScheme.send() needs init_on_sender() first (pass it to a collector)")
        self._group.stage(self.model_id, weights)

    @property
    def store(self) -> WeightStore | None:
        """The store (sender side or worker side), or None before initialization."""
        if self._group is not None:
            return self._group.store
        if self._receiver is not None:
            return self._receiver.store
        return None

    @property
    def version(self) -> int:
        """Sender: the last published version. Receiver: the version loaded in this worker."""
        if self._receiver is not None:
            return self._receiver.reader_version
        store = self.store
        return store.version if store is not None else -1

    def create_transport(self, **kwargs: Any):
        raise NotImplementedError("ShmWeightSyncScheme moves weights through a WeightStore, not a transport")

    # -- receiver -------------------------------------------------------------------------------
    def _init_on_receiver_impl(
        self, model_id: str, context: Any = None, model: Any = None, worker_idx: int | None = None, **kwargs: Any
    ) -> None:
        if self._store_name is None:
            raise RuntimeError("this ShmWeightSyncScheme was never initialized on a sender (no store to attach to)")
        self.model_id = model_id
        self.worker_idx = worker_idx
        if context is not None:
            self.context = context
        if model is not None:
            self.model = model
        self._receiver = _Receiver(self)
        _RECEIVERS.setdefault(self._store_name, []).append(self._receiver)

    def _setup_connection_and_weights_on_receiver_impl(self, *, worker_idx: int | None = None) -> None:
        self._receiver.poll()  # first load (the policy may still be on the meta device)

    def receive(self, timeout: float | None = None) -> None:
        """Load the newest version if it changed (cheap otherwise). Weights never travel by message."""
        if self._receiver is not None:
            self._receiver.poll()
        return None

    def poll(self) -> bool:
        """Worker side: reload if a new version was published. True if reloaded."""
        return self._receiver.poll() if self._receiver is not None else False

    # -- lifetime -------------------------------------------------------------------------------
    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["source"] = None  # the trainer's module stays with the trainer
        state["_group"] = None
        state["_receiver"] = None
        return state

    def shutdown(self) -> None:
        super().shutdown()
        receiver, self._receiver = getattr(self, "_receiver", None), None
        if receiver is not None:
            receiver.close()
        group, self._group = getattr(self, "_group", None), None
        if group is not None:
            group.close()


class _SenderGroup:
    """Main process: one store for all the keys of a collector that use this scheme."""

    def __init__(self, collector: Any, schemes: dict[str, ShmWeightSyncScheme]) -> None:
        self.keys = list(schemes)
        first = next(iter(schemes.values()))
        models = {key: _model_of(collector, key, scheme) for key, scheme in schemes.items()}
        self.store = WeightStore.create(models, name=f"torchrl-{secrets.token_hex(6)}", num_slots=first.num_slots)
        self._models = {
            key: weakref.ref(m) if isinstance(m, nn.Module) else (lambda m=m: m) for key, m in models.items()
        }
        self._pending: dict[str, Any] = {}
        self._depth = 0
        self._patch(collector, first)

    @classmethod
    def join(cls, scheme: ShmWeightSyncScheme, collector: Any) -> _SenderGroup:
        if collector is None:
            raise ValueError("ShmWeightSyncScheme must be initialized with the collector as context")
        group = collector.__dict__.get("_shmsync_group")
        if group is None:
            schemes = {
                k: s for k, s in (collector._weight_sync_schemes or {}).items() if isinstance(s, ShmWeightSyncScheme)
            }
            if scheme.model_id not in schemes:
                schemes[scheme.model_id] = scheme
            group = cls(collector, schemes)
            collector.__dict__["_shmsync_group"] = group
        return group

    def _patch(self, collector: Any, scheme: ShmWeightSyncScheme) -> None:
        """Wrap the collector so that one update call is one version, and shutdown frees memory."""
        update, shutdown = collector.update_policy_weights_, collector.shutdown
        group_ref = weakref.ref(self)

        @functools.wraps(update)
        def update_policy_weights_(*args: Any, **kwargs: Any) -> Any:
            group = group_ref()
            if group is None:
                return update(*args, **kwargs)
            with group.transaction():
                return update(*args, **kwargs)

        @functools.wraps(shutdown)
        def shutdown_and_release(*args: Any, **kwargs: Any) -> Any:
            try:
                return shutdown(*args, **kwargs)
            finally:
                group = group_ref()
                if group is not None:
                    group.close()

        collector.update_policy_weights_ = update_policy_weights_
        collector.shutdown = shutdown_and_release
        # Workers poll at the start of every rollout, before the user's own hook.
        collector._worker_pre_collect_hook = _PollBeforeRollout(
            self.store.name, getattr(collector, "_worker_pre_collect_hook", None)
        )
        if scheme.version_key is not None and hasattr(collector, "_worker_post_collect_hook"):
            collector._worker_post_collect_hook = _TagNext(scheme.version_key, collector._worker_post_collect_hook)

    class _Transaction:
        def __init__(self, group: _SenderGroup) -> None:
            self.group = group

        def __enter__(self) -> None:
            self.group._depth += 1

        def __exit__(self, exc_type, *exc) -> None:
            group = self.group
            group._depth -= 1
            if group._depth == 0:
                if exc_type is None and group._pending:
                    group.flush()
                group._pending.clear()

    def transaction(self) -> _SenderGroup._Transaction:
        return _SenderGroup._Transaction(self)

    def stage(self, key: str, weights: Any) -> None:
        self._pending[key] = weights
        if self._depth == 0:
            try:
                self.flush()
            finally:
                self._pending.clear()

    def flush(self) -> int:
        source = {}
        for key in self.keys:
            weights = self._pending.get(key)
            if weights is None:
                weights = self._models[key]()
                if weights is None:
                    raise RuntimeError(f"the collector's model for {key!r} no longer exists")
            source[key] = _as_weights(weights)
        return self.store.publish(source)

    def close(self) -> None:
        if not self.store.closed:
            self.store.close()


class _Receiver:
    """Worker process: the reader for one key, bound to whatever model the scheme points at."""

    def __init__(self, scheme: ShmWeightSyncScheme) -> None:
        self.scheme = scheme
        self.store = WeightStore.attach(scheme._store_name)
        self.reader: WeightReader | None = None
        self.token = secrets.token_hex(4)
        self.calls = 0

    @property
    def reader_version(self) -> int:
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
        return self.current().poll()

    def _install_hooks(self, model: nn.Module) -> None:
        if getattr(model, "_shmsync_hooks", None) == self.token:
            return  # copied along with the module: the closures already point here
        model.__dict__["_shmsync_hooks"] = self.token
        # state_dict() of the worker's policy shows the newest published weights.
        model.register_state_dict_pre_hook(_state_dict_pre_hook(self))
        every, key = self.scheme.poll_every_steps, self.scheme.version_key
        if every is not None:
            model.register_forward_pre_hook(_step_poll_hook(self, every))
        if key is not None:
            tag_versions(model, lambda: self.reader_version, key)

    def close(self) -> None:
        receivers = _RECEIVERS.get(self.store.name, [])
        if self in receivers:
            receivers.remove(self)
        self.store.close()


# Hooks are closures, not bound methods: deep-copying a module copies its hooks, and a
# copied bound method would copy the receiver (and its mapping) with it.
def _state_dict_pre_hook(receiver: _Receiver) -> Callable:
    def hook(module, prefix, keep_vars):
        receiver.poll()

    return hook


def _step_poll_hook(receiver: _Receiver, every: int) -> Callable:
    def hook(module, args):
        receiver.calls += 1
        if receiver.calls % every == 0:
            receiver.poll()

    return hook


class _PollBeforeRollout:
    """Picklable ``pre_collect_hook``: poll this process's receivers, then the user's hook."""

    def __init__(self, store_name: str, then: Callable[[], None] | None) -> None:
        self.store_name, self.then = store_name, then

    def __call__(self) -> None:
        for receiver in _RECEIVERS.get(self.store_name, ()):
            receiver.poll()
        if self.then is not None:
            self.then()


class _TagNext:
    """Picklable ``post_collect_hook``: copy the version tag to ``("next", key)``, then the user's hook."""

    def __init__(self, key: str, then: Callable[[TensorDictBase], None] | None) -> None:
        self.key, self.then = key, then

    def __call__(self, batch: TensorDictBase) -> None:
        if self.key in batch.keys():
            root, nxt = batch.get(self.key), batch.get(("next", self.key), None)
            if nxt is not None and nxt.shape == root.shape:
                nxt.copy_(root)  # in place: the batch may live in buffers shared with the trainer
            else:
                batch.set(("next", self.key), root.clone())
        if self.then is not None:
            self.then(batch)


def _model_of(collector: Any, key: str, scheme: ShmWeightSyncScheme) -> nn.Module:
    if scheme.source is not None:
        return scheme.source
    try:
        model = collector.get_model(key)
    except (AttributeError, KeyError, IndexError, ValueError) as e:
        raise ValueError(
            f"weight sync key {key!r} does not resolve on the collector in the main process ({e}); "
            f"pass ShmWeightSyncScheme(source=the trainer's module for {key!r})"
        ) from None
    if not isinstance(model, nn.Module):
        raise ValueError(f"weight sync key {key!r}: the collector's model is a {type(model).__name__}, not a module")
    return model


def _as_weights(weights: Any) -> Any:
    """What ``update_policy_weights_`` may pass, as something ``WeightStore.publish`` takes."""
    if isinstance(weights, (nn.Module, TensorDictBase)):
        return weights
    if isinstance(weights, dict):
        return TensorDict(weights).unflatten_keys(".") if all(isinstance(k, str) for k in weights) else weights
    raise TypeError(f"cannot publish weights of type {type(weights).__name__}")
