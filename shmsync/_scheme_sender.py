"""Main-process side of :class:`~shmsync.ShmWeightSyncScheme`: the stores and the collector glue.

One :class:`SenderGroup` holds the stores behind a collector's shmsync keys: one store shared
by every worker, or one per worker (``per_worker_weights``). All keys live in each store as
destinations, so the keys sent by one ``update_policy_weights_`` call form one version.

What version a publish gets: the one given (``update_policy_weights_(version=n)``); on a node of a
distributed collector, the trainer's push count (:mod:`shmsync._distributed`); on a Ray actor's
collector, the push's ``model_version``, which TorchRL hands over only after the push's weights
reached the scheme, so they are staged until then (:mod:`shmsync._ray`); else the next one.

At its first update the group checks that every worker attached to its store: a TorchRL that
stopped setting up the scheme in its workers would otherwise leave them on their first weights.
"""

from __future__ import annotations

import functools
import logging
import secrets
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from . import _torchrl_compat as compat
from ._distributed import mark_ready, pushed_version
from ._ray import is_ray_actor_collector
from ._scheme_worker import sync_tracker
from .errors import ShmSyncError
from .store import WeightStore

log = logging.getLogger("shmsync.scheme")
REPLACED = "MultiCollector.update_policy_weights_ / shutdown / load_state_dict, replaced on the instance"
DEFER_PATIENCE = 2.0  # seconds a staged push waits for its version before it is published anyway
ATTACH_PATIENCE = 30.0  # seconds the first update waits for workers still attaching
GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # collector -> its sender groups


class SenderGroup:
    """The stores of one collector (or of one scheme initialized before any collector).

    Args:
        models: one mapping ``{key: module or TensorDict}`` per store: a single one when all
            workers share weights, else one per worker, in worker order.
        num_workers: the number of workers when known (checks ``worker_ids``).
        devices: each worker's policy device when known (resolves device ``worker_ids``).
    """

    def __init__(
        self,
        models: list[dict[str, Any]],
        *,
        num_slots: int,
        num_workers: int | None = None,
        devices: Sequence[Any] | None = None,
    ) -> None:
        self.keys = list(models[0])
        self.models = models  # held: a model built here from a factory has no other owner
        self.per_worker = len(models) > 1
        self.num_workers = len(models) if self.per_worker else num_workers
        self.devices = list(devices) if devices is not None else None
        token = secrets.token_hex(6)
        self.stores: list[WeightStore] = []
        try:
            for i, m in enumerate(models):
                suffix = f"-w{i}" if self.per_worker else ""
                self.stores.append(WeightStore.create(m, name=f"torchrl-{token}{suffix}", num_slots=num_slots))
        except BaseException:
            self.close()
            raise
        self._pending: dict[str, tuple[Any, tuple[int, ...]]] = {}
        self._depth = 0
        self._collector: weakref.ref | None = None
        self._staged: list[tuple[WeightStore, dict[str, Any]]] | None = None  # a push awaiting its version
        self._staged_lock = threading.Lock()
        self._attached_checked = False

    def expected_readers(self) -> int | None:
        """Readers that attach to each store: a worker's reader per key (None if not known)."""
        if self.num_workers is None:
            return None
        return len(self.keys) * (1 if self.per_worker else self.num_workers)

    @property
    def store_names(self) -> list[str]:
        return [s.name for s in self.stores]

    # -- publishing -------------------------------------------------------------------------------
    def stage(self, key: str, weights: Any, worker_ids: Any = None) -> None:
        """Queue ``weights`` for ``key``; published at once, or when the update call ends."""
        self._pending[key] = (weights, self._targets(key, weights, worker_ids))
        if self._depth == 0:
            self.flush()

    def _targets(self, key: str, weights: Any, worker_ids: Any) -> tuple[int, ...]:
        """The stores an update reaches, checked before anything is written."""
        if _is_per_worker(weights):
            if worker_ids is not None:
                raise ValueError(f"key {key!r}: pass per-worker weights {{worker: weights}} or worker_ids, not both")
            ids, what = sorted(weights), "per-worker weights"
        elif worker_ids is None:
            return tuple(range(len(self.stores)))
        else:
            ids, what = self._worker_indices(worker_ids), f"worker_ids={worker_ids!r}"
        if self.num_workers is not None:
            unknown = [i for i in ids if not 0 <= i < self.num_workers]
            if unknown:
                raise ValueError(f"key {key!r}: {what} name workers {unknown}; there are {self.num_workers}")
        if self.per_worker:
            return tuple(ids)
        if self.num_workers is not None and set(ids) == set(range(self.num_workers)):
            return (0,)
        raise ValueError(
            f"key {key!r}: {what} would update only some workers, but every worker of this collector "
            "loads one shared set of weights; build the scheme with "
            "ShmWeightSyncScheme(per_worker_weights=True) to give each worker its own"
        )

    def _worker_indices(self, worker_ids: Any) -> list[int]:
        ids = worker_ids if isinstance(worker_ids, (list, tuple)) else [worker_ids]
        out: list[int] = []
        for w in ids:
            if isinstance(w, (str, torch.device)):
                if self.devices is None:
                    raise ValueError(f"worker_ids={worker_ids!r}: the workers' devices are not known to this scheme")
                # No device given to the collector: the policy stays where it is built, on the CPU.
                matches = [i for i, d in enumerate(self.devices) if torch.device(d or "cpu") == torch.device(w)]
                if not matches:
                    raise ValueError(f"worker_ids={worker_ids!r}: no worker runs on {w}")
                out += matches
            elif isinstance(w, int) and not isinstance(w, bool):
                out.append(w)
            else:
                raise TypeError(f"worker_ids must be ints or devices, got {type(w).__name__}")
        return sorted(set(out))

    def flush(self) -> list[int]:
        """Publish what is staged; every store is checked before any is written."""
        prepared = self.prepare()
        check_all(prepared)
        return self.commit(prepared)

    def prepare(self) -> list[tuple[WeightStore, dict[str, Any]]]:
        """Take what is staged: ``(store, source)`` pairs (see :func:`check_all`)."""
        pending, self._pending = self._pending, {}
        targets = sorted({w for _, ids in pending.values() for w in ids})
        return [(self.stores[w], self._source(w, pending)) for w in targets]

    def commit(self, prepared: list[tuple[WeightStore, dict[str, Any]]], version: int | None = None) -> list[int]:
        self._check_workers_attached()
        versions = [store.publish(source, version=version) for store, source in prepared]
        self._sync_tracker()
        return versions

    def hold(self, prepared: list[tuple[WeightStore, dict[str, Any]]]) -> None:
        """Hold a push's weights until its version comes (:meth:`commit_held`), or for
        :data:`DEFER_PATIENCE` seconds, after which they are published under the next version."""
        with self._staged_lock:
            self._staged = prepared
        timer = threading.Timer(DEFER_PATIENCE, self._publish_unversioned, args=(prepared,))
        timer.daemon = True
        timer.start()

    def commit_held(self, version: int | None) -> None:
        """Publish the staged push under ``version`` (the trainer's; None: the next one). A version
        this store already holds, or an older one, publishes nothing: that push is in already."""
        with self._staged_lock:
            prepared, self._staged = self._staged, None
        if prepared is None:
            return
        if version is not None and all(int(version) <= store.version for store, _ in prepared):
            return
        self.commit(prepared, None if version is None else int(version))

    def _publish_unversioned(self, prepared: list) -> None:
        with self._staged_lock:
            if self._staged is not prepared:
                return  # its version came
            self._staged = None
        log.warning(
            "shmsync: a push reached this collector's scheme, but TorchRL did not tell its version within %.0f s "
            "(torchrl %s): published under the next version instead",
            DEFER_PATIENCE,
            compat.torchrl.__version__,
        )
        if not self.closed:
            self.commit(prepared, None)

    def _check_workers_attached(self) -> None:
        """Once: every worker's reader attached (waiting a little for late ones), else raise."""
        if self._attached_checked or self._collector is None:
            return
        self._attached_checked = True
        expected = self.expected_readers()
        if expected is None:
            return
        deadline = time.monotonic() + ATTACH_PATIENCE
        while True:
            attached = [len(store.readers()) for store in self.stores]
            if min(attached) >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for store, n in zip(self.stores, attached):
            if n < expected:
                raise ShmSyncError(
                    f"only {n} of the {expected} worker readers attached to store {store.name!r} "
                    f"(torchrl {compat.torchrl.__version__}): TorchRL did not set the scheme up in every worker, "
                    "which would then run its first weights forever"
                )

    def _source(self, w: int, pending: dict[str, tuple[Any, tuple[int, ...]]]) -> dict[str, Any]:
        source = {}
        for key in self.keys:
            weights, ids = pending.get(key, (None, ()))
            if w in ids and _is_per_worker(weights):
                weights = weights[w]
            elif w not in ids:
                weights = None
            source[key] = self.models[w][key] if weights is None else weights
        return source

    def relabel(self, versions: Sequence[int | None]) -> None:
        """Republish each store's newest weights under a restored version, when it is higher."""
        for store, wanted in zip(self.stores, versions):
            if wanted is not None and int(wanted) > store.version:
                store.publish(store.snapshot().weights, version=int(wanted))
        self._sync_tracker()

    def _sync_tracker(self) -> None:
        collector = self._collector() if self._collector is not None else None
        sync_tracker(collector, max(s.version for s in self.stores))

    # -- the collector --------------------------------------------------------------------------
    def attach(self, collector: Any) -> None:
        """Wrap ``collector`` so that one update call is one version (under the right number),
        shutdown frees the stores, and a restored state dict restores the workers' versions."""
        if self.per_worker and getattr(collector, "num_workers", self.num_workers) != self.num_workers:
            raise ValueError(
                f"this scheme holds per-worker weights for {self.num_workers} workers, "
                f"the collector has {collector.num_workers}"
            )
        self._collector = weakref.ref(collector)
        groups = GROUPS.setdefault(collector, [])
        if self in groups:
            return
        groups.append(self)
        if len(groups) > 1:
            return  # the wrappers below serve every group of this collector
        num_workers = getattr(collector, "num_workers", None)
        ray_glue = []  # set once this collector shows it is a Ray actor's (its receiver comes later)

        def on_ray_actor() -> bool:
            if not ray_glue and is_ray_actor_collector(collector):
                compat.replace_method(
                    collector,
                    "_set_received_policy_version",
                    received_version_wrapper,
                    "BaseCollector._set_received_policy_version",
                )
                ray_glue.append(True)
            return bool(ray_glue)

        def live_groups() -> list[SenderGroup]:
            return [g for g in GROUPS.get(collector, ()) if not g.closed]

        def update_wrapper(update: Any) -> Any:
            @functools.wraps(update)
            def update_policy_weights_(*args: Any, version: int | None = None, **kwargs: Any) -> Any:
                # `version`: shmsync's own keyword (TorchRL's method has none): the version to
                # publish under, e.g. the optimizer-step count, instead of the next one.
                if version is None:
                    version = pushed_version(collector, kwargs.get("model_id"))  # on a node
                groups = live_groups()
                for g in groups:
                    g._depth += 1
                try:
                    result = update(*args, **kwargs)
                except BaseException:
                    for g in groups:
                        g._depth -= 1
                        g._pending.clear()
                    raise
                for g in groups:
                    g._depth -= 1
                # Every store of every group is checked before any is written.
                try:
                    prepared = [(g, g.prepare()) for g in groups if g._pending]
                    check_all([pair for _, pairs in prepared for pair in pairs], version)
                except BaseException:
                    for g in groups:
                        g._pending.clear()
                    raise
                held = version is None and on_ray_actor()
                for g, pairs in prepared:
                    if held:
                        g.hold(pairs)  # its version comes with _set_received_policy_version
                    else:
                        g.commit(pairs, version)
                return result

            return update_policy_weights_

        def shutdown_wrapper(shutdown: Any) -> Any:
            @functools.wraps(shutdown)
            def shutdown_and_release(*args: Any, **kwargs: Any) -> Any:
                try:
                    return shutdown(*args, **kwargs)
                finally:
                    for g in live_groups():
                        g.close()

            return shutdown_and_release

        def load_state_dict_wrapper(load_state_dict: Any) -> Any:
            @functools.wraps(load_state_dict)
            def load_state_dict_and_versions(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
                result = load_state_dict(state_dict, *args, **kwargs)
                saved = [_saved_version(state_dict, i) for i in range(num_workers or 0)]
                for g in live_groups():
                    g.relabel(saved if g.per_worker else [max((v for v in saved if v is not None), default=None)])
                return result

            return load_state_dict_and_versions

        def received_version_wrapper(set_received: Any) -> Any:
            @functools.wraps(set_received)
            def set_received_policy_version(model_version: int | None) -> Any:
                for g in live_groups():
                    g.commit_held(model_version)
                return set_received(model_version)

            return set_received_policy_version

        compat.replace_method(collector, "update_policy_weights_", update_wrapper, REPLACED)
        compat.replace_method(collector, "shutdown", shutdown_wrapper, REPLACED)
        compat.replace_method(collector, "load_state_dict", load_state_dict_wrapper, REPLACED)
        mark_ready(collector)

    @property
    def closed(self) -> bool:
        return all(store.closed for store in self.stores)

    def close(self) -> None:
        """Free the stores (a closed store still tells its last version)."""
        for store in self.stores:
            if not store.closed:
                store.close()


def check_all(prepared: list[tuple[WeightStore, Any]], version: int | None = None) -> None:
    """Check each ``(store, source)`` pair (and ``version``) before any is published, so that an
    update reaching several stores writes all or none. A single store checks as it publishes,
    before it writes anything: checking it twice would only cost time."""
    if len(prepared) > 1:
        for store, source in prepared:
            store.check(source, version=version)


def find_collector(scheme: Any) -> Any:
    """The collector that is connecting ``scheme``, found among the callers of ``connect()``:
    TorchRL hands a scheme initialized before its collector no reference to it."""

    def owns(owner: Any) -> bool:
        schemes = getattr(owner, "_weight_sync_schemes", None)
        return isinstance(schemes, dict) and any(s is scheme for s in schemes.values())

    return compat.caller_owning(owns, "the call stack of MultiCollector.connect")


def _saved_version(state_dict: Any, worker: int) -> int | None:
    worker_state = state_dict.get(f"worker{worker}") if hasattr(state_dict, "get") else None
    version = worker_state.get("policy_version") if hasattr(worker_state, "get") else None
    return int(version) if isinstance(version, (int, torch.Tensor)) and not isinstance(version, bool) else None


def _is_per_worker(weights: Any) -> bool:
    return isinstance(weights, dict) and bool(weights) and all(isinstance(k, int) for k in weights)
