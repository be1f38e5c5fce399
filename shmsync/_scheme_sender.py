"""Main-process side of :class:`~shmsync.ShmWeightSyncScheme`: the stores and the collector glue.

One :class:`SenderGroup` holds the stores behind a collector's shmsync keys: one store shared
by every worker, or one per worker (``per_worker_weights``). All keys live in each store as
destinations, so the keys sent by one ``update_policy_weights_`` call form one version.
"""

from __future__ import annotations

import functools
import secrets
import sys
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from ._distributed import mark_ready, trainer_version
from ._scheme_worker import sync_tracker
from .store import WeightStore


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
        versions = [store.publish(source, version=version) for store, source in prepared]
        self._sync_tracker()
        return versions

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
        """Wrap ``collector`` so that one update call is one version, shutdown frees the stores,
        and a restored state dict restores the workers' versions."""
        if self.per_worker and getattr(collector, "num_workers", self.num_workers) != self.num_workers:
            raise ValueError(
                f"this scheme holds per-worker weights for {self.num_workers} workers, "
                f"the collector has {collector.num_workers}"
            )
        self._collector = weakref.ref(collector)
        groups = collector.__dict__.setdefault("_shmsync_groups", [])
        if self in groups:
            return
        groups.append(self)
        if len(groups) > 1:
            return  # the wrappers below serve every group of this collector
        update, shutdown = collector.update_policy_weights_, collector.shutdown
        load_state_dict = collector.load_state_dict
        num_workers = getattr(collector, "num_workers", None)

        def live_groups() -> list[SenderGroup]:
            return [g for g in collector.__dict__.get("_shmsync_groups", ()) if not g.closed]

        @functools.wraps(update)
        def update_policy_weights_(*args: Any, version: int | None = None, **kwargs: Any) -> Any:
            # `version`: shmsync's own keyword (TorchRL's method has none): the version to
            # publish under, e.g. the optimizer-step count, instead of the next one. On a node of
            # a distributed collector: the trainer's version of the push being applied.
            if version is None:
                version = trainer_version(collector, kwargs.get("model_id"))
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
            for g, pairs in prepared:
                g.commit(pairs, version)
            return result

        @functools.wraps(shutdown)
        def shutdown_and_release(*args: Any, **kwargs: Any) -> Any:
            try:
                return shutdown(*args, **kwargs)
            finally:
                for g in live_groups():
                    g.close()

        @functools.wraps(load_state_dict)
        def load_state_dict_and_versions(state_dict: Any, *args: Any, **kwargs: Any) -> Any:
            result = load_state_dict(state_dict, *args, **kwargs)
            saved = [_saved_version(state_dict, i) for i in range(num_workers or 0)]
            for g in live_groups():
                g.relabel(saved if g.per_worker else [max((v for v in saved if v is not None), default=None)])
            return result

        collector.update_policy_weights_ = update_policy_weights_
        collector.shutdown = shutdown_and_release
        collector.load_state_dict = load_state_dict_and_versions
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


def find_collector(scheme: Any, depth: int = 8) -> Any:
    """The collector that is connecting ``scheme``, found on the call stack.

    TorchRL hands a scheme initialized before the collector existed no reference to it; the
    collector is the caller of ``connect()``.
    """
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        schemes = getattr(owner, "_weight_sync_schemes", None)
        if isinstance(schemes, dict) and any(s is scheme for s in schemes.values()):
            return owner
        frame = frame.f_back
    return None


def _saved_version(state_dict: Any, worker: int) -> int | None:
    worker_state = state_dict.get(f"worker{worker}") if hasattr(state_dict, "get") else None
    version = worker_state.get("policy_version") if hasattr(worker_state, "get") else None
    return int(version) if isinstance(version, (int, torch.Tensor)) and not isinstance(version, bool) else None


def _is_per_worker(weights: Any) -> bool:
    return isinstance(weights, dict) and bool(weights) and all(isinstance(k, int) for k in weights)
