"""The trainer's side of :class:`~shmsync.ShmWeightSyncScheme`: one collector's stores, and the one
route every publish of that collector takes.

A :class:`StoreGroup` holds the stores behind a collector's shmsync keys: one store shared by
every worker, or one per worker (``per_worker_weights``). All keys live in each store as
destinations, so one update is one version: the keys given get their new weights, the others keep
theirs.

A :class:`Publisher` is made when TorchRL gives a scheme its collector (``init_on_sender(context=
collector)``), or by a scheme initialized before any collector. Every publish goes through
:meth:`Publisher.route`, whichever entry point the user calls: TorchRL's loop calls each
scheme's ``send()``, and the collector's :class:`CollectorPatches` wrap ``update_policy_weights_``
on its instance so that the keys one call names are published as one version (TorchRL offers no
hook around one update call, and drops unknown keywords such as ``version=``). Three more public
methods are wrapped on that one instance, each over a path that stays correct without it:
``shutdown`` (frees the stores at once; else they go with the schemes), ``load_state_dict``
(republishes under the restored versions) and ``iterator`` (publishes again at each hand-out of
work what training changed since, and gives each batch ``("next", key)`` where a worker could not
tag it); a fifth, ``worker_policy_versions``, on torchrl 0.15.

A publish's version is, in order: the one given (``update_policy_weights_(version=n)``); on a
collector that is another process's remote node (a node, a Ray actor), the trainer's number of the
push being applied (:mod:`shmsync.torchrl.remote_nodes`), never a guess; else the store's next.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from tensordict import TensorDictBase

from shmsync.core.segment import default_name
from shmsync.errors import (
    ArgumentTypeError,
    ClosedError,
    FreshnessWarning,
    InvalidArgumentError,
    UnknownKeyError,
    WrittenWhileCopiedError,
)
from shmsync.store.reader_table import ReaderTable, merge
from shmsync.torchrl import at_exit, compat
from shmsync.torchrl.settings import SchemeSettings
from shmsync.torchrl.trainer_weights import models_of, models_without_collector, per_store
from shmsync.watch.alarm import ReaderAlarm
from shmsync.watch.frames import tag_next
from shmsync.writer.store import WeightStore, check_version

ATTACH_PATIENCE = 5.0  # seconds the first check waits for workers still attaching
_PUBLISHERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # collector -> its publisher


class RemotePushes(Protocol):
    """A collector that is another process's remote node: the trainer's numbers of its pushes, and
    what it reports of each push it applies (see :mod:`shmsync.torchrl.remote_nodes`)."""

    def take(self) -> int:
        """The trainer's number of the push being applied, taken once (raises if none was named)."""

    def applied(self, version: int) -> None:
        """The push numbered ``version`` is published to this collector's workers."""

    def failed(self, error: BaseException) -> None:
        """The push could not be published: report it to the trainer, or raise it."""

    def started(self) -> None:
        """The collector's stores exist (a node tells the trainer, which waits for it)."""


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


class Publisher:
    """The route of every publish of one collector (or of one scheme initialized before any
    collector: then ``collector`` is None): its groups of stores, the versions they publish under,
    and TorchRL's tracker told of each. What is wrapped on the collector is its
    :class:`CollectorPatches`' job.

    Args:
        collector: the TorchRL collector, or None.
        pushes: set when the collector is another process's remote node (a node, a Ray actor).
    """

    def __init__(self, collector: Any = None, pushes: RemotePushes | None = None) -> None:
        self._collector = weakref.ref(collector) if collector is not None else lambda: None
        self.pushes = pushes
        self.groups: list[StoreGroup] = []
        self.keys: set[str] = set()  # the collector's shmsync keys
        self.unchecked: list[StoreGroup] = []  # groups whose workers are still to be seen attached
        self.version_keys: list[str] = []
        self.num_workers = getattr(collector, "num_workers", None)
        # TorchRL's policy-version tracker: checked now, before any worker starts.
        self.report_version = compat.version_setter(collector) if collector is not None else None

    @classmethod
    def of(cls, collector: Any) -> Publisher | None:
        """The publisher of ``collector``, if it has one."""
        return _PUBLISHERS.get(collector)

    @classmethod
    def group_with(cls, collector: Any, key: str) -> StoreGroup | None:
        """The group ``collector`` already made for ``key`` (with its other shmsync keys), if any."""
        publisher = _PUBLISHERS.get(collector)
        return next((g for g in publisher.groups if key in g.keys), None) if publisher is not None else None

    def serve(self) -> None:
        """Be its collector's publisher (:meth:`of` finds it), once its patches are on the collector;
        left running at exit, the collector is named on stderr, then shut down."""
        _PUBLISHERS[self.collector] = self
        at_exit.watch(self)

    @property
    def collector(self) -> Any:
        return self._collector()

    def add(self, group: StoreGroup, version_key: str | None) -> None:
        """Serve ``group`` (its stores hold this collector's keys)."""
        if group in self.groups:
            return
        self.groups.append(group)
        self.keys.update(group.keys)
        if self.collector is not None:
            self.unchecked.append(group)  # the first batch or update checks that every worker attached
        if version_key is not None and version_key not in self.version_keys:
            self.version_keys.append(version_key)

    def live_groups(self) -> list[StoreGroup]:
        return [g for g in self.groups if not g.closed]

    # -- the one route of a publish ---------------------------------------------------------------
    def route(self, weights: dict[str, Any], worker_ids: Any = None, given: int | None = None) -> None:
        """Publish ``weights`` (key -> weights, or None for the key's model) as one version, whatever
        groups the keys live in (all checked before any is written), under ``given`` if set. On a
        remote node the version is the trainer's number of the push being applied, and the
        trainer is told how it went (an error goes to it, not up this stack)."""
        pushes = self.pushes
        if self.unchecked and pushes is None:  # a remote node applies pushes while still being built
            self.check_attached()
        groups = [g for g in self.groups if not g.closed and any(k in g.keys for k in weights)]
        if not groups:
            self._refuse_if_shut_down(weights)
            return
        try:
            # A push the trainer did not number is refused (take() raises), never guessed.
            version = given if given is not None or pushes is None else pushes.take()
            if len(groups) == 1:
                newest = groups[0].publish_keys(weights, worker_ids, version)
            else:
                newest = _to_several(groups, weights, worker_ids, version)
            if self.report_version is not None:  # TorchRL's tracker told
                self.report_version(_promised(self.groups))
        except BaseException as error:
            if pushes is None:
                raise
            pushes.failed(error)
            return
        if pushes is not None:
            pushes.applied(newest)

    def publish_models(
        self, keys: set[str], *, version: int | None = None, if_changed: bool = False
    ) -> tuple[list[int], list[str]]:
        """Publish the models of ``keys`` into each group's stores (the hand-out's route: see
        :class:`CollectorPatches`), each a new version (under ``version`` if given), or, with
        ``if_changed``, only where they changed since its newest version; the tracker told.
        Returns the versions published, and the keys of the groups whose models another thread
        kept writing while they were copied (those published nothing)."""
        published: list[int] = []
        written: list[str] = []
        for group in self.live_groups():
            mine = keys.intersection(group.keys)
            try:
                published += group.publish_models(mine, version=version, if_changed=if_changed) if mine else []
            except WrittenWhileCopiedError:
                written += sorted(mine)
        if published and self.report_version is not None:
            self.report_version(_promised(self.groups))
        return published, written

    def promised(self, keys: Collection[str]) -> int:
        """The newest promised version of the stores holding ``keys`` (-1 if none)."""
        groups = [g for g in self.live_groups() if any(k in keys for k in g.keys)]
        return max((s.promised for g in groups for s in g.stores), default=-1)

    def tell_tracker(self, version: int) -> None:
        """TorchRL's tracker told ``version``: the one an update waiting for its hand-out will carry."""
        if self.report_version is not None:
            self.report_version([*_promised(self.groups), version])

    def check_update(self, keys: Collection[str], version: int | None) -> None:
        """Raise now what publishing the models of ``keys`` under ``version`` later would raise
        for them, writing nothing: the collector shut down, a stale worker the alarm found, a
        version not above the last (see :class:`CollectorPatches`' deferred updates)."""
        groups = [g for g in self.live_groups() if any(k in g.keys for k in keys)]
        if not groups:
            self._refuse_if_shut_down(dict.fromkeys(keys))
            return
        for group in groups:
            if group.alarm is not None and group.alarm.pending:
                group.alarm.raise_pending()
            if version is not None:
                for store in group.stores:
                    check_version(version, store.promised, store.name)

    def differs(self, keys: set[str]) -> bool:
        """Whether the models of ``keys`` differ from what their stores hold now (read only)."""
        return any(g.differs(keys.intersection(g.keys)) for g in self.live_groups() if keys.intersection(g.keys))

    def _refuse_if_shut_down(self, weights: dict[str, Any]) -> None:
        """An update of keys whose stores this collector closed (it was shut down) raises
        :class:`~shmsync.errors.ClosedError`, or, on a remote node, reports it to the trainer:
        doing nothing would leave the caller believing its workers got the weights."""
        keys = sorted(k for k in weights if k in self.keys)
        if not keys:
            return
        error = ClosedError(
            f"the collector is shut down: its shmsync stores are closed, so the update of {keys} reaches no "
            "worker (build a new collector)"
        )
        if self.pushes is None:
            raise error
        self.pushes.failed(error)

    def check_attached(self) -> None:
        """Once per group: every worker's reader attached (TorchRL set the scheme up in each)."""
        while self.unchecked:
            self.unchecked.pop().check_workers_attached()


@dataclass
class Due:
    """An update waiting for its thread's next hand-out: the keys it named, the version it will
    carry, and whether the caller named that version (else it is the one after the last)."""

    keys: set[str]
    version: int
    numbered: bool


class CollectorPatches:
    """shmsync's wrappers on one collector's instance, each over a public method of TorchRL's
    (TorchRL's class is left alone; see the module's docstring for why each is wrapped): the update
    call goes to its :class:`Publisher`'s route, and the weights an update named without passing
    them reach the workers' next work as they are when that work is handed out.

    When updates are published (:meth:`hand_out` has the reasons):

    * an update with no weights, on the thread iterating a collector whose workers wait between
      batches (``MultiSyncCollector``), is published when the collector hands out the next batch:
      no worker runs the weights before that, and TorchRL's default scheme shows them the
      trainer's weights as they are then. One copy per batch, whichever order the loop updates
      and trains in;
    * any other update (weights passed, ``worker_ids``, another thread, workers that collect all
      along) is published before the call returns; where it named no weights, the next hand-out on
      its thread publishes again what training changed since.

    Args:
        publisher: the collector's publisher, the route of every publish.
        collector: the TorchRL collector.
    """

    # The methods wrapped, each by the method of the same name here (``worker_policy_versions``
    # where the collector has it: torchrl 0.15).
    WRAPPED = (
        "update_policy_weights_",
        "shutdown",
        "state_dict",
        "load_state_dict",
        "iterator",
        "worker_policy_versions",
    )

    def __init__(self, publisher: Publisher, collector: Any) -> None:
        self.publisher = publisher
        self._collector = weakref.ref(collector)
        # Per thread, the keys of its updates to be published at its next hand-out (deferred), and
        # the version they named (None: each store's next).
        self.due: dict[int, Due] = {}
        # Keys an update published with no weights since the collector last handed out work, and
        # the thread that named them: at the next hand-out on that thread they are published again
        # where training changed them (see hand_out).
        self.fresh: dict[str, int] = {}
        self.numbered: dict[str, int] = {}  # likewise, but under a version the caller numbered
        self.marks = threading.Lock()  # another thread may update while this one hands out
        self.handing_out = 0  # the thread inside TorchRL's iterator, which updates before it hands out
        self.iterating: collections.Counter[int] = collections.Counter()  # threads with a live iterator
        self.warned = False  # FreshnessWarning: once per collector
        self.hands_out = publisher.pushes is None  # a remote node's pushes are the trainer's
        # Its workers wait between batches: an update is published at the next hand-out.
        self.defers = self.hands_out and compat.runs_sent_weights_next(collector)
        self.numbered_checked = False

    def install(self) -> None:
        """Wrap each method of :attr:`WRAPPED` the collector has on its instance."""
        collector = self._collector()
        for method in self.WRAPPED:
            if method != "worker_policy_versions" or compat.has_worker_versions(collector):
                compat.wrap_on_instance(collector, method, functools.partial(_bind, getattr(self, method)))

    # -- the hand-out -----------------------------------------------------------------------------
    def hand_out(self) -> None:
        """The collector is about to hand its workers their next work. Publish the updates made on
        this thread since the last hand-out: those deferred (one new version of the trainer's
        models as they are now, copied checked), and, where an update was published already
        with no weights, what training changed since (nothing changed: nothing published). The
        work then runs the trainer's weights as they are now, as with TorchRL's default scheme
        (which lets workers read the trainer's live weights).

        Only updates made on this thread, the one that iterates the collector, are published here:
        an update from another thread marks where that thread's writes stand whole, and its
        snapshot stays what the workers run (a copy taken here could catch that thread in the
        middle of writing the weights, where no copy can tell it is). A copy taken here is
        checked, all the same: a write another thread makes while it is taken is caught."""
        me = threading.get_ident()
        self._publish_due(me)
        with self.marks:
            fresh = {k for k, thread in self.fresh.items() if thread == me}
            numbered = {k for k, thread in self.numbered.items() if thread == me}
            self.fresh, self.numbered = {}, {}
        if numbered and not self.numbered_checked:
            self.numbered_checked = True  # compared once: a loop that changes nothing pays it once
            if self.publisher.differs(numbered):
                self._warn(
                    f"update_policy_weights_(version=...) published {sorted(numbered)} before the weights were "
                    "changed again, and a version the caller numbers cannot be published once more at the next "
                    "batch: the workers run the weights as they were at that call, older than TorchRL's default "
                    "scheme would give them. Call update_policy_weights_() after the optimizer steps, or leave "
                    "version= out"
                )
        if fresh:
            self._publish_fresh(fresh)

    def _publish_due(self, thread: int) -> None:
        """Publish the update ``thread`` made that waits for a hand-out (if any): one new version of
        its keys' models, said where another thread's writes kept every copy from being whole (the
        workers then run the newest version there is). Called at the hand-out, when the iteration
        ends (nothing is handed out on that thread any more), and before the workers' weights are
        read (``state_dict``)."""
        with self.marks:
            due = self.due.pop(thread, None)
        if due is None:
            return
        # The number noted, unless another thread published past it meanwhile and none was given.
        number = due.version if due.numbered else max(due.version, self.publisher.promised(due.keys) + 1)
        _, written = self.publisher.publish_models(due.keys, version=number)
        if written:
            self._warn(
                f"the weights of {written} were being written by another thread each time shmsync copied "
                "them as the collector handed out work, so the update_policy_weights_() made before published "
                "nothing: its workers run the newest version there was. Publish from the thread that writes "
                "them, or pass them: update_policy_weights_(weights)"
            )

    def _publish_fresh(self, keys: set[str]) -> None:
        """The hand-out's publish of ``keys``, where their models changed; said once where the
        workers ran older weights than TorchRL's default would have given them."""
        published, written = self.publisher.publish_models(keys, if_changed=True)
        if written:
            self._warn(
                f"the weights of {written} were being written by another thread each time shmsync copied "
                "them as the collector handed out work: its workers run the snapshot update_policy_weights_() "
                "took. Publish from the thread that writes them, or pass them: update_policy_weights_(weights)"
            )
        collector = self._collector()
        if published and not compat.runs_sent_weights_next(collector):
            self._warn(
                f"{type(collector).__name__}'s workers collect while the trainer trains: the training done after "
                "update_policy_weights_() reached them only now, as the next batch was asked for (TorchRL's default "
                "scheme shows it to them at every optimizer step, unversioned). Call update_policy_weights_() after "
                "the optimizer steps for fresher weights"
            )

    def _warn(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(message, FreshnessWarning, stacklevel=4)

    # -- the wrappers, each named as the collector's method it wraps ------------------------------
    def update_policy_weights_(self, original: Callable, *args: Any, version: int | None = None, **kwargs: Any) -> Any:
        """The shmsync keys it names, one version (the publisher's route, or at the next hand-out:
        see the class); the rest, TorchRL's."""
        keys = self.publisher.keys
        weights, worker_ids = compat.update_request(args, kwargs) if args or kwargs else ({"policy": None}, None)
        rest = {k: w for k, w in weights.items() if k not in keys}
        result = original(weights_dict=rest, worker_ids=worker_ids) if rest else None
        mine = {k: w for k, w in weights.items() if k in keys}
        me = threading.get_ident()
        if mine and self._deferred(mine, worker_ids, me):
            self._defer(set(mine), version, me)
        else:
            self._publish_now(mine, worker_ids, version, me)
        return result

    def _defer(self, keys: set[str], version: int | None, me: int) -> None:
        """Note an update of ``keys`` for the next hand-out on this thread, under the version it
        will carry (``version``, else the one after the last; the batch it reaches is tagged so,
        and TorchRL's tracker is told so now). What publishing it would refuse is refused now."""
        with self.marks:
            due = self.due.get(me)
            last = due.version if due is not None else self.publisher.promised(keys)
            if version is not None:
                check_version(version, last)
            number = version if version is not None else last + 1
            self.publisher.check_update(keys, number)
            if due is None:
                self.due[me] = due = Due(set(), number, numbered=False)
            due.keys |= keys
            due.version, due.numbered = number, due.numbered or version is not None
            for key in keys:
                self.fresh.pop(key, None)
                self.numbered.pop(key, None)
        self.publisher.tell_tracker(number)

    def _publish_now(self, mine: dict[str, Any], worker_ids: Any, version: int | None, me: int) -> None:
        """Publish the update before returning (see the class), after an update this thread made
        before that still waits for its hand-out; note the keys it named without weights for the
        next hand-out on this thread (:meth:`hand_out`), keys given weights keep those."""
        if self.handing_out != me:
            self._publish_due(me)
        self.publisher.route(mine, worker_ids, given=version)
        if self.hands_out and self.handing_out != me:  # not TorchRL's own update right before a hand-out
            with self.marks:
                for key, w in mine.items():
                    self.fresh.pop(key, None)
                    self.numbered.pop(key, None)
                    if w is None:
                        (self.fresh if version is None else self.numbered)[key] = me

    def _deferred(self, mine: dict[str, Any], worker_ids: Any, me: int) -> bool:
        """Whether this update is published at the next hand-out rather than now: no weights, no
        ``worker_ids``, on a thread that iterates a collector whose workers wait between batches,
        outside TorchRL's own iterator."""
        return (
            self.defers
            and worker_ids is None
            and self.iterating[me] > 0
            and self.handing_out != me
            and all(w is None for w in mine.values())
        )

    def shutdown(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        """TorchRL's shutdown, then the stores freed at once (else they go with the schemes); an
        update waiting for a hand-out goes with the workers."""
        with self.marks:
            self.due = {}
        try:
            return original(*args, **kwargs)
        finally:
            for g in self.publisher.live_groups():
                g.close()

    def state_dict(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        """TorchRL's state, with an update this thread made that waits for its hand-out published
        first: the workers report the weights and the version the trainer sent them."""
        self._publish_due(threading.get_ident())
        return original(*args, **kwargs)

    def load_state_dict(self, original: Callable, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        """TorchRL's load, then each store's newest weights republished under the restored versions."""
        result = original(state_dict, *args, **kwargs)
        saved = [_saved_version(state_dict, i) for i in range(self.publisher.num_workers or 0)]
        for g in self.publisher.live_groups():
            g.relabel(saved if g.per_worker else [max((v for v in saved if v is not None), default=None)])
        return result

    def worker_policy_versions(self, original: Callable, *args: Any, **kwargs: Any) -> dict[int, int | None]:
        """``worker_policy_versions()`` (torchrl 0.15): each worker's loaded version, from the readers'
        table (no message, no pause; a frozen worker answers too); None for a worker with no reader
        attached, and for every worker without ``track_policy_version``, as TorchRL answers."""
        publisher = self.publisher
        if "policy" not in publisher.keys:  # another scheme syncs the policy: TorchRL asks the workers
            return original(*args, **kwargs)
        workers = publisher.num_workers or 0  # a collector's publisher: its collector has workers
        if publisher.report_version is None:  # no track_policy_version
            return dict.fromkeys(range(workers))
        loaded: dict[int, int] = {}
        for row in merge([g.readers() for g in publisher.live_groups()]):
            if row.worker is not None:  # a worker runs the oldest of its keys' versions
                loaded[row.worker] = min(row.version, loaded.get(row.worker, row.version))
        return {w: loaded.get(w) for w in range(workers)}

    def iterator(self, original: Callable, *args: Any, **kwargs: Any) -> Iterator[Any]:
        """Each batch of TorchRL's iterator; before TorchRL hands out work (the first, and each one
        after the caller's code ran on a batch), :meth:`hand_out`; each batch gets ``("next", key)``
        where a worker could not tag it. An update still waiting for a hand-out when the iteration
        ends (the last batch, ``break``) is published then."""
        self.publisher.check_attached()  # before the first batch: a worker left out would run its first weights
        version_keys = self.publisher.version_keys
        batches = original(*args, **kwargs)
        me = threading.get_ident()
        self.iterating[me] += 1
        try:
            while True:
                self.hand_out()
                self.handing_out = me
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                finally:
                    self.handing_out = 0
                if version_keys and isinstance(batch, TensorDictBase):
                    for key in version_keys:
                        if batch.get(("next", key), None) is None and key in batch.keys():
                            tag_next(batch, key)
                yield batch
        finally:
            self.iterating[me] -= 1
            try:
                batches.close()
            finally:
                if self.iterating[me] <= 0:
                    del self.iterating[me]
                    self._publish_due(me)  # nothing is handed out on this thread any more


def _promised(groups: list[StoreGroup]) -> list[int]:
    """The newest promised version of each store of the live ``groups`` (what TorchRL's tracker is told)."""
    return [s.promised for g in groups if not g.closed for s in g.stores]


def _to_several(groups: list[StoreGroup], weights: dict[str, Any], worker_ids: Any, version: int | None) -> int:
    """One version in several groups, all checked before any is written; the newest published."""
    parts = [(g, {k: w for k, w in weights.items() if k in g.keys}) for g in groups]
    check_all([pair for g, w in parts for pair in g.prepare(w, worker_ids)], version)
    return max(g.publish_keys(w, worker_ids, version) for g, w in parts)


def _bind(method: Callable, original: Callable) -> Callable:
    """``method(original, ...)`` as the instance's method (a C partial: no frame of its own)."""
    wrapper = functools.partial(method, original)
    functools.update_wrapper(wrapper, original)
    return wrapper


class SchemeOfKey(Protocol):
    """What the trainer's side reads of a :class:`~shmsync.ShmWeightSyncScheme`: its key, its
    settings, and the group it made before any collector existed (None until then)."""

    model_id: str
    settings: SchemeSettings

    @property
    def group(self) -> StoreGroup | None: ...


def publisher_and_group(
    scheme: SchemeOfKey, collector: Any, make_pushes: Callable[[], RemotePushes] | None
) -> tuple[Publisher, StoreGroup]:
    """The publisher of ``collector`` and the group that holds ``scheme``'s key: the one the
    collector made for all its shmsync keys at once, the one ``scheme`` made before the collector
    existed, or a new one for every shmsync key of the collector; ``make_pushes()`` gives a new
    publisher the pushes of its remote node, where the collector is another process's (None: it is not). A
    remote node copies each push before it returns, even with ``unsafe_background_copy``: TorchRL's
    receiving thread writes the next push into the same module at once.

    Raises:
        ArgumentTypeError: a single-process collector (nothing to sync).
        InvalidArgumentError: per-worker weights for another number of workers.
    """
    publisher = Publisher.of(collector)
    served = Publisher.group_with(collector, scheme.model_id)
    if served is not None and publisher is not None:
        return publisher, served
    if not hasattr(collector, "num_workers"):
        raise ArgumentTypeError(
            f"ShmWeightSyncScheme syncs the worker processes of a multi-process collector (MultiSyncCollector, "
            f"MultiAsyncCollector); {type(collector).__name__} runs the trainer's policy in this process, so there "
            "is nothing to sync: drop weight_sync_schemes there (shmsync.tag_versions(policy, ...) tags its frames "
            "if you need versions)"
        )
    # Made before the collector existed, or now for every shmsync key of the collector.
    group = scheme.group if scheme.group is not None else _group_of_keys(scheme, collector, make_pushes is not None)
    try:
        if group.per_worker and collector.num_workers != group.num_workers:
            raise InvalidArgumentError(
                f"this scheme holds per-worker weights for {group.num_workers} workers, "
                f"the collector has {collector.num_workers}"
            )
        if publisher is None:
            publisher = Publisher(collector, make_pushes() if make_pushes is not None else None)
            CollectorPatches(publisher, collector).install()
            publisher.serve()
        publisher.add(group, scheme.settings.version_key)
    except BaseException:
        if scheme.group is None:
            group.close()
        raise
    if publisher.pushes is not None:
        publisher.pushes.started()
    return publisher, group


def _group_of_keys(scheme: SchemeOfKey, collector: Any, remote: bool) -> StoreGroup:
    """A new group for every shmsync key of ``collector`` whose scheme made none yet."""
    schemes = {k: s for k, s in compat.schemes_of(collector).items() if isinstance(s, type(scheme)) and s.group is None}
    schemes[scheme.model_id] = scheme
    return group_for(collector, {key: s.settings for key, s in schemes.items()}, scheme.settings, remote)


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


def _saved_version(state_dict: Any, worker: int) -> int | None:
    worker_state: Any = state_dict.get(f"worker{worker}") if hasattr(state_dict, "get") else None
    version = worker_state.get("policy_version") if hasattr(worker_state, "get") else None
    return int(version) if isinstance(version, (int, torch.Tensor)) and not isinstance(version, bool) else None
