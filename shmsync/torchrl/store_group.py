"""The stores behind one collector's shmsync keys (:class:`StoreGroup`), and how they are made.

A group holds one store shared by every worker, or one per worker (``per_worker_weights``). All
keys live in each store as destinations, so one update is one version: the keys given get their
new weights, the others keep theirs. :func:`group_for` makes a collector's group from its keys'
models; :func:`group_before_collector` a scheme's that was initialized before any collector.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from shmsync.core.segment import default_name
from shmsync.errors import ArgumentTypeError, InvalidArgumentError, UnknownKeyError
from shmsync.store.reader_table import ReaderTable, merge
from shmsync.torchrl import compat
from shmsync.torchrl.settings import SchemeSettings
from shmsync.torchrl.trainer_weights import models_of, models_without_collector, per_store
from shmsync.watch.alarm import ReaderAlarm
from shmsync.writer.store import WeightStore

ATTACH_PATIENCE = 5.0  # seconds the first check waits for workers still attaching


class StoreGroup:
    """The stores of one collector (or of one scheme initialized before any collector).

    Args:
        models: one mapping ``{key: module or TensorDict}`` per store: a single one when all
            workers share weights, else one per worker, in worker order.
        num_slots: copies kept in shared memory per store.
        num_workers: the number of workers when known (checks ``worker_ids``).
        devices: each worker's policy device when known (resolves device ``worker_ids``).
        unsafe_background_copy: CPU publishes return before their copy (see
            :meth:`~shmsync.WeightStore.create`; this gives up the snapshot). Default False.
    """

    def __init__(
        self,
        models: list[dict[str, Any]],
        *,
        num_slots: int,
        num_workers: int | None = None,
        devices: Sequence[Any] | None = None,
        unsafe_background_copy: bool = False,
    ) -> None:
        self.keys = list(models[0])
        self.models = models  # held: a model built here from a factory has no other owner
        self.per_worker = len(models) > 1
        self.num_workers = len(models) if self.per_worker else num_workers
        self.devices = list(devices) if devices is not None else None
        self.alarm: ReaderAlarm | None = None
        self.closed = False
        base = default_name("torchrl")
        self.stores: list[WeightStore] = []
        try:
            for i, m in enumerate(models):
                name = f"{base}-w{i}" if self.per_worker else base
                store = WeightStore.create(
                    m, name=name, num_slots=num_slots, unsafe_background_copy=unsafe_background_copy
                )
                self.stores.append(store)
        except BaseException:
            self.close()
            raise

    def readers(self, processes: bool = False, memory: bool | None = None) -> ReaderTable:
        """The readers' table of every store of the group."""
        return merge([store.readers(processes=processes, memory=memory) for store in self.stores])

    def start_alarm(self, settings: dict[str, Any] | None) -> None:
        """Watch the group's readers with a stale-worker alarm of ``settings`` (once; None: none)."""
        if settings is not None and self.alarm is None:
            self.alarm = ReaderAlarm(self.readers, **settings).start()

    def expected_readers(self) -> int | None:
        """Readers that attach to each store: a worker's reader per key (None if not known)."""
        if self.num_workers is None:
            return None
        return len(self.keys) * (1 if self.per_worker else self.num_workers)

    @property
    def store_names(self) -> list[str]:
        return [s.name for s in self.stores]

    @property
    def version(self) -> int:
        """The newest complete version of any of the stores: published, so workers can load it."""
        return max(s.version for s in self.stores)

    @property
    def promised(self) -> int:
        """The newest promised version of any of the stores: a publish begun whose copy may still be
        in flight (from CUDA, or in the background); :attr:`version` once it landed."""
        return max(s.promised for s in self.stores)

    def publish_keys(self, weights: dict[str, Any], worker_ids: Any = None, version: int | None = None) -> int:
        """Publish the keys of ``weights`` (new weights, or None for the key's own model) into every
        store they reach, each store's other keys from their models, as one version a store
        (``version``, or each store's next); everything is checked before anything is written.
        Returns the newest version published.

        Raises:
            StaleReaderError: the alarm (``on_stale="raise"``) found a stale worker; nothing published.
            ValueError, WeightMismatchError: an update aimed at workers or weights that do not fit.
        """
        if self.alarm is not None and self.alarm.pending:
            self.alarm.raise_pending()
        models = self.models[0]
        if worker_ids is None and not self.per_worker and all(k in models for k in weights):
            # One store for every worker: its keys' new weights, the others' models as they are.
            if all(models[k] is w or w is None for k, w in weights.items()):
                return self.stores[0].publish(models, version=version)  # the trainer's own models: checked fast
            if not any(_is_per_worker(w) for w in weights.values()):
                source = {k: m if weights.get(k) is None else weights[k] for k, m in models.items()}
                return self.stores[0].publish(source, version=version)
        prepared = self.prepare(weights, worker_ids)
        check_all(prepared, version)
        return max(store.publish(source, version=version) for store, source in prepared)

    def prepare(self, weights: dict[str, Any], worker_ids: Any = None) -> list[tuple[WeightStore, dict[str, Any]]]:
        """``(store, source)`` for every store the update of ``weights`` reaches (nothing written)."""
        unknown = [k for k in weights if k not in self.keys]
        if unknown:
            raise UnknownKeyError(f"keys {unknown} are not in this collector's shmsync stores (they hold {self.keys})")
        targets = {key: self._targets(key, w, worker_ids) for key, w in weights.items()}
        reached = sorted(set().union(*targets.values())) if targets else []
        return [(self.stores[w], self._source(w, weights, targets)) for w in reached]

    def relabel(self, versions: Sequence[int | None]) -> None:
        """Republish each store's newest weights under a restored version, when it is higher."""
        for store, wanted in zip(self.stores, versions):
            if wanted is not None and int(wanted) > store.promised:
                store.publish(store.snapshot().weights, version=int(wanted))

    def publish_models(
        self, keys: Collection[str], *, version: int | None = None, if_changed: bool = False
    ) -> list[int]:
        """The models of ``keys`` into each store as a new version, the other keys keeping theirs,
        copied checked: other threads may write the models meanwhile (see
        :meth:`~shmsync.WeightStore.publish` and :meth:`~shmsync.WeightStore.publish_if_changed`).
        ``if_changed``: only into the stores where they differ from the newest version. Returns
        the versions published.

        Raises:
            StaleReaderError: the alarm (``on_stale="raise"``) found a stale worker; nothing published.
            WrittenWhileCopiedError: another thread kept writing the models; that store published nothing.
        """
        if self.alarm is not None and self.alarm.pending:
            self.alarm.raise_pending()
        if if_changed:
            published = [store.publish_if_changed(models, only=keys) for store, models in zip(self.stores, self.models)]
            return [v for v in published if v is not None]
        return [
            store.publish(models, version=version, only=keys, checked=True)
            for store, models in zip(self.stores, self.models)
        ]

    def differs(self, keys: Collection[str]) -> bool:
        """Whether the models of ``keys`` differ from what some store of the group holds now."""
        return any(store.differs(models, only=keys) for store, models in zip(self.stores, self.models))

    def check_workers_attached(self) -> None:
        """For a collector's stores (its publisher calls this once): every worker's reader attached
        (waiting a little for late ones), else raise. Once the collector is built, TorchRL has
        set the scheme up in every worker it started."""
        expected = self.expected_readers()
        if expected is None:
            return
        deadline = time.monotonic() + ATTACH_PATIENCE
        while True:
            attached = [len(store.readers(processes=False)) for store in self.stores]
            if min(attached) >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        for store, n in zip(self.stores, attached):
            compat.check_workers_set_up(n, expected, store.name)

    def _targets(self, key: str, weights: Any, worker_ids: Any) -> tuple[int, ...]:
        """The stores an update reaches, checked before anything is written."""
        if _is_per_worker(weights):
            if worker_ids is not None:
                raise InvalidArgumentError(
                    f"key {key!r}: pass per-worker weights {{worker: weights}} or worker_ids, not both"
                )
            ids, what = sorted(weights), "per-worker weights"
        elif worker_ids is None:
            return tuple(range(len(self.stores)))
        else:
            ids, what = self._worker_indices(worker_ids), f"worker_ids={worker_ids!r}"
        if self.num_workers is not None:
            unknown = [i for i in ids if not 0 <= i < self.num_workers]
            if unknown:
                raise InvalidArgumentError(f"key {key!r}: {what} name workers {unknown}; there are {self.num_workers}")
        if self.per_worker:
            return tuple(ids)
        if self.num_workers is not None and set(ids) == set(range(self.num_workers)):
            return (0,)
        raise InvalidArgumentError(
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
                    raise InvalidArgumentError(
                        f"worker_ids={worker_ids!r}: the workers' devices are not known to this scheme"
                    )
                # No device given to the collector: the policy stays where it is built, on the CPU.
                matches = [i for i, d in enumerate(self.devices) if torch.device(d or "cpu") == torch.device(w)]
                if not matches:
                    raise InvalidArgumentError(f"worker_ids={worker_ids!r}: no worker runs on {w}")
                out += matches
            elif isinstance(w, int) and not isinstance(w, bool):
                out.append(w)
            else:
                raise ArgumentTypeError(f"worker_ids must be ints or devices, got {type(w).__name__}")
        return sorted(set(out))

    def _source(self, w: int, weights: dict[str, Any], targets: dict[str, tuple[int, ...]]) -> dict[str, Any]:
        """What store ``w`` publishes: the new weights of the keys aimed at it, the rest as they are."""
        source = {}
        for key in self.keys:
            new = weights.get(key) if w in targets.get(key, ()) else None
            if isinstance(new, dict) and _is_per_worker(new):
                new = new[w]
            source[key] = self.models[w][key] if new is None else new
        return source

    def close(self) -> None:
        """Free the stores (a closed store still tells its last version)."""
        self.closed = True
        if self.alarm is not None:
            self.alarm.stop()
        for store in self.stores:
            if not store.closed:
                store.close()


def group_before_collector(
    model_id: str,
    settings: SchemeSettings,
    model: Any,
    weights: Any,
    params_map: Any,
    devices: Sequence[Any] | None,
    device_map_fn: Callable | None,
    num_workers: int | None,
) -> StoreGroup:
    """The stores of a scheme initialized before any collector (``init_on_sender(model=...)`` and its
    other forms, see :func:`~shmsync.torchrl.trainer_weights.models_without_collector`)."""
    models, workers, _ = models_without_collector(
        settings.per_worker_weights, model, weights, params_map, devices, device_map_fn, num_workers
    )
    return StoreGroup(
        [{model_id: m} for m in models],
        num_slots=settings.num_slots,
        num_workers=workers,
        devices=devices,
        unsafe_background_copy=settings.unsafe_background_copy,
    )


def group_for(collector: Any, keys: dict[str, SchemeSettings], asking: SchemeSettings, remote: bool) -> StoreGroup:
    """The group of stores for a collector's shmsync keys (key -> its scheme's settings): one store,
    or one per worker when any key has per-worker weights. ``asking``: the settings of the scheme
    that makes it (slots, background copy); ``remote``: the collector is a remote collector's node."""
    workers = collector.num_workers
    per_key = {key: models_of(collector, key, s.source, workers) for key, s in keys.items()}
    per_worker = any(s.per_worker_weights for s in keys.values()) or any(len(m) > 1 for m in per_key.values())
    return StoreGroup(
        per_store(per_key, workers if per_worker else 1),
        num_slots=asking.num_slots,
        num_workers=workers,
        devices=getattr(collector, "policy_device", None),
        unsafe_background_copy=asking.unsafe_background_copy and not remote,
    )


def check_all(prepared: list[tuple[WeightStore, Any]], version: int | None = None) -> None:
    """Check each ``(store, source)`` pair (and ``version``) before any is published, so that an
    update reaching several stores writes all or none. A single store checks as it publishes,
    before it writes anything: checking it twice would only cost time."""
    if len(prepared) > 1:
        for store, source in prepared:
            store.check(source, version)


def _is_per_worker(weights: Any) -> bool:
    return isinstance(weights, dict) and bool(weights) and all(isinstance(k, int) for k in weights)
