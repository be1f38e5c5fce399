"""``ShmWeightSyncScheme``: TorchRL's multi-process collectors on shmsync stores.

Sender (main process): the collector's models for every key that uses this scheme go into one
:class:`~shmsync.WeightStore` (one per worker with ``per_worker_weights``), held by the
collector's :class:`~shmsync.torchrl.publisher.Publisher`; ``update_policy_weights_()`` publishes
into it and returns, with no message to and no acknowledgement from any worker. All keys sent by
one ``update_policy_weights_`` call are published together as one version.

Receiver (each worker): a :class:`~shmsync.torchrl.receiver.Receiver` attaches, loads the first
weights into the (meta-device) policy, then checks the version before every rollout and at every
policy call, and reloads only when it changed. Each frame is tagged with the version of the
weights that produced it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from tensordict import TensorDictBase
from torch import nn
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme

from shmsync.errors import InvalidArgumentError, NotAttachedError, NotSupportedError, ShmSyncError, warn_deprecated
from shmsync.store.reader_table import ReaderTable, RemoteSources, assemble, merge
from shmsync.torchrl import compat
from shmsync.torchrl.collector_patches import publisher_and_group
from shmsync.torchrl.publisher import Publisher
from shmsync.torchrl.receiver import Receiver
from shmsync.torchrl.remote_nodes import make_pushes
from shmsync.torchrl.scheme_sides import ReceiverSide, SenderSide
from shmsync.torchrl.settings import SchemeSettings
from shmsync.torchrl.store_group import StoreGroup, group_before_collector
from shmsync.watch.alarm import STALE_AFTER, ReaderAlarm, StaleEvent
from shmsync.writer.store import WeightStore


class ShmWeightSyncScheme(WeightSyncScheme):
    """TorchRL's weight-sync scheme for ``MultiSyncCollector`` / ``MultiAsyncCollector`` on shmsync
    stores: its job is TorchRL's scheme API, on the trainer's side (a collector's
    :class:`~shmsync.torchrl.publisher.Publisher`) and in each worker (a
    :class:`~shmsync.torchrl.receiver.Receiver`).

    Each update is a snapshot: once ``update_policy_weights_()`` returns, the trainer may write its
    weights any way. Workers load only whole, published versions (in place on the CPU and on the
    GPU the trainer publishes from), the trainer never waits for them, and under
    ``MultiSyncCollector`` the batch after an update runs it. Every way TorchRL initializes a scheme
    works: by the collector, or before any with ``init_on_sender(model=..., devices=...)``,
    ``(weights=..., devices=...)`` or ``(params_map={worker: weights})``.

    Args:
        poll_every_steps: check for new weights at every this many-th policy call (and before
            each rollout). Default: at every call (a version check: see the Performance page).
        version_key: the key under which every collected frame records the version of the
            weights that produced it (also under ``("next", version_key)``); None: nothing.
        num_slots: slots per store (see :meth:`WeightStore.create`); a slot holds memory only
            while it holds a version someone uses. Default 4: every worker of a
            ``MultiSyncCollector`` runs in place across a version change; a ``MultiAsyncCollector``
            needs ``workers + 2`` for all of them to (up to 16).
        zero_copy: workers run their policy on the store's memory in place (see
            :class:`~shmsync.WeightReader`). Default (None): where they can. False gives every
            worker a private copy, for a policy that writes its own parameters.
        unsafe_background_copy: let each update from CPU tensors return before its copy, which
            then reads the trainer's live weights on a background thread. This gives up the
            snapshot: the trainer must not write those weights until the copy landed (an
            optimizer step waits by itself; ``scheme.store.flush()`` waits too). A write through
            ``.data`` meanwhile may be published mixed; any other write is found, that version is
            dropped and its promise withdrawn. Never used on a remote collector's node or actor.
            Default False: every update copies before it returns, so the trainer may write its
            weights any way at once.
        source: the trainer-side module for this key, when the collector cannot resolve it in the
            main process (a key such as ``"env.transform[0]"`` that exists only in each worker).
        per_worker_weights: give each worker its own weights and versions (one store per worker),
            as TorchRL's argument of that name does; turned on by itself for a list of distinct
            ``policy_factory``. Without it, an update aimed at some workers only raises.
        stale_after: seconds a running worker may stay at an old version before the stale-worker
            alarm names it (see :mod:`shmsync.watch.alarm`); None: no limit. Default 30.
        max_lag: versions a running worker may fall behind before the alarm names it (None).
        on_stale: ``"warn"`` (default), ``"raise"`` (a :class:`~shmsync.errors.StaleReaderError`
            at the next update), a function called with each
            :class:`~shmsync.watch.alarm.StaleEvent`, or None for no alarm.
        strategy: TorchRL's weight-extraction strategy name (weights always travel as tensors).

    Examples:
        >>> from torchrl.collectors import MultiSyncCollector  # doctest: +SKIP
        >>> collector = MultiSyncCollector(
        ...     [make_env] * 2, policy, frames_per_batch=200, total_frames=-1,
        ...     weight_sync_schemes={"policy": ShmWeightSyncScheme()},
        ... )  # doctest: +SKIP
        >>> for batch in collector:  # doctest: +SKIP
        ...     train_on(batch)
        ...     collector.update_policy_weights_()  # publish: returns at once

        Before any collector exists, as with TorchRL's schemes:

        >>> scheme = ShmWeightSyncScheme()
        >>> scheme.init_on_sender(model=nn.Linear(3, 1), devices=["cpu"] * 2, model_id="policy")
        >>> scheme.store.version
        0
        >>> scheme.shutdown()
    """

    def __init__(
        self,
        *,
        poll_every_steps: int | None = None,
        version_key: str | None = "policy_version",
        num_slots: int | None = None,
        zero_copy: bool | None = None,
        unsafe_background_copy: bool = False,
        source: nn.Module | None = None,
        per_worker_weights: bool = False,
        stale_after: float | None = STALE_AFTER,
        max_lag: int | None = None,
        on_stale: str | Callable[[StaleEvent], Any] | None = "warn",
        strategy: str = "tensordict",
    ) -> None:
        self.sender_side = SenderSide()  # the trainer's (or a node's): stores, the route of a publish
        self.receiver_side = ReceiverSide()  # what a worker's copy needs, and its receiver there
        super().__init__(strategy)
        self.model_id: str | None = None  # the key, once TorchRL hands it (init_on_sender, init_on_receiver)
        self.worker_idx: int | None = None  # in a worker: its index, once TorchRL hands it
        self.settings = SchemeSettings(
            poll_every_steps=poll_every_steps,
            version_key=version_key,
            num_slots=num_slots if num_slots is not None else 4,
            zero_copy=zero_copy,
            unsafe_background_copy=bool(unsafe_background_copy),
            source=source,
            per_worker_weights=per_worker_weights,
            alarm=SchemeSettings.alarm_of(stale_after, max_lag, on_stale),
        )

    # -- sender ---------------------------------------------------------------------------------
    @property
    def group(self) -> StoreGroup | None:
        """Sender: the stores of this scheme's key (None before initialization, and in a worker)."""
        return self.sender_side.group

    @property
    def remote_rows(self) -> RemoteSources:
        """Sender: where a distributed or Ray collector's nodes report their workers."""
        return self.sender_side.remote_rows

    @property
    def runs_sent_weights_next(self) -> bool:
        """Its collector's next batch runs the weights an update sent (``MultiSyncCollector``): each
        worker waits at a rollout's start for a version the trainer promised (told to every worker)."""
        return self.receiver_side.runs_sent_weights_next

    @property
    def initialized_on_sender(self) -> bool:
        """Whether TorchRL need not initialize it on a sender. A scheme initialized before any
        collector says no until one does: the collector then hands itself over
        (``init_on_sender(context=collector)``, see the catalogue's entry in ``compat``)."""
        return WeightSyncScheme.initialized_on_sender.fget(self) and not self.sender_side.awaiting_collector

    def _init_on_sender_impl(
        self,
        *,
        model_id: str | None = None,
        context: Any = None,
        ctx: Any = None,
        model: nn.Module | None = None,
        weights: TensorDictBase | None = None,
        params_map: dict[int, Any] | None = None,
        devices: Sequence[Any] | None = None,
        device_map_fn: Callable[[int, TensorDictBase], TensorDictBase] | None = None,
        num_workers: int | None = None,
    ) -> None:
        sender = self.sender_side
        if context is None:
            self.model_id = model_id if model_id is not None else "policy"
            sender.group = group_before_collector(
                self.model_id, self.settings, model, weights, params_map, devices, device_map_fn, num_workers
            )
            sender.awaiting_collector = True  # TorchRL's collector hands itself over (initialized_on_sender)
        else:
            extra = [k for k, v in dict(model=model, weights=weights, params_map=params_map, devices=devices,
                                        device_map_fn=device_map_fn).items() if v is not None]  # fmt: skip
            if extra:
                raise InvalidArgumentError(f"init_on_sender(context=...) takes model_id only, not {extra}")
            if model_id is None:
                raise InvalidArgumentError("init_on_sender(context=...) needs model_id")
            self.model_id = model_id
            self.context = context
            if sender.remote_kind is not None and not hasattr(context, "num_workers"):
                return  # the trainer's single-process probe of a distributed collector: nothing to sync
            kind, upstream = sender.remote_kind, sender.upstream
            sender.publisher, sender.group = publisher_and_group(
                self, context, (lambda: make_pushes(kind, context, model_id, upstream)) if kind else None
            )
            sender.awaiting_collector = False
            self.receiver_side.runs_sent_weights_next = compat.runs_sent_weights_next(context)
        group = sender.group
        self.receiver_side.store_names = group.store_names
        self.receiver_side.expected_readers = group.expected_readers()
        group.start_alarm(self.settings.alarm)

    def _setup_connection_and_weights_on_sender_impl(self, *, worker_idx: int | None = None, weights: Any = None):
        if self.group is None:
            return  # the trainer's probe of a distributed collector
        # Initialized before any collector, and no collector handed itself over since.
        compat.check_collector_handed_over(not self.sender_side.awaiting_collector)
        if weights is not None:
            self.send(weights)  # the store already holds the initial weights: workers load them alone

    def send(self, weights: Any = None, worker_ids: Any = None) -> None:
        """Publish ``weights`` for this key (default: the model the scheme was built from), at once.

        Returns once the store holds (or promised) it. ``weights``: a module, a TensorDict, a state
        dict, or ``{worker index: weights}`` with ``per_worker_weights``; ``worker_ids`` (ints or
        devices) limits the update to those workers (``per_worker_weights``, or all of them).
        """
        sender = self.sender_side
        if sender.group is None or self.model_id is None:
            raise NotAttachedError(self._why_unattached("send() has no store to publish into"))
        if sender.publisher is None:
            sender.publisher = Publisher()  # no collector yet: the same route, nothing wrapped
            sender.publisher.add(sender.group, self.settings.version_key)
        sender.publisher.route({self.model_id: weights}, worker_ids)

    @property
    def stores(self) -> tuple[WeightStore, ...]:
        """Sender: every store (one, or one per worker). Receiver: this worker's store."""
        if self.group is not None:
            return tuple(self.group.stores)
        receiver = self.receiver_side.receiver
        if receiver is not None:
            return (receiver.store,)
        return ()

    @property
    def store(self) -> WeightStore | None:
        """The store (sender or worker side), or None before initialization; ValueError with
        ``per_worker_weights`` on the sender side (see :attr:`stores`)."""
        stores = self.stores
        if len(stores) > 1:
            raise InvalidArgumentError("per_worker_weights: one store per worker, see ShmWeightSyncScheme.stores")
        return stores[0] if stores else None

    @property
    def version(self) -> int:
        """Sender: the newest complete version of any store (published: workers can load it).
        Receiver: the version loaded in this worker. Once the collector shut down, the last version
        its stores held.

        Raises:
            NotAttachedError: the scheme has no stores, as for :meth:`readers` and :meth:`send`
                (no collector set it up, or the scheme itself was shut down): a number would read
                as a version that workers run.
        """
        receiver = self.receiver_side.receiver
        if receiver is not None:
            return receiver.version
        if self.group is None and self.sender_side.remote_kind is None:
            raise NotAttachedError(self._why_unattached("it has no version"))
        return max((s.version for s in self.stores), default=-1)

    @property
    def promised(self) -> int:
        """Sender: the newest promised version of any store, that of the last update (its copy may
        still be in flight, from CUDA or in the background); :attr:`version` once it landed.
        Receiver: the newest promised version of the store this worker loads from.

        Raises:
            NotAttachedError: as :attr:`version`.
        """
        receiver = self.receiver_side.receiver
        if receiver is not None:
            return receiver.store.promised
        if self.group is None and self.sender_side.remote_kind is None:
            raise NotAttachedError(self._why_unattached("it has no version"))
        return max((s.promised for s in self.stores), default=-1)

    @property
    def exact(self) -> bool:
        """Deprecated: :attr:`runs_sent_weights_next` (renamed in 0.3.0, removed in 0.4.0)."""
        warn_deprecated("ShmWeightSyncScheme.exact", "ShmWeightSyncScheme.runs_sent_weights_next", "0.4.0")
        return self.runs_sent_weights_next

    @property
    def steps(self) -> int:
        """Optimizer steps the trainer has taken on this scheme's weights so far (see
        :attr:`WeightStore.steps <shmsync.WeightStore.steps>`); 0 before any store exists."""
        return max((s.steps for s in self.stores), default=0)

    def steps_of(self, version: int) -> int | None:
        """The optimizer steps ``version`` had seen when it was published, for
        ``staleness(batch, scheme, unit="optim_steps")`` (None where no store knows it)."""
        return next((n for n in (s.steps_of(version) for s in self.stores) if n is not None), None)

    @property
    def versions(self) -> list[int]:
        """Sender: the newest complete version of each store (one per worker with ``per_worker_weights``)."""
        return [s.version for s in self.stores]

    def readers(self, *, processes: bool = True) -> ReaderTable:
        """The readers' table (:mod:`shmsync.store.reader_table`): on the trainer, every worker (each
        store's, and a distributed or Ray collector's nodes' or actors', as last reported); in a
        worker, its store's. No message, no wait: it works mid-rollout, with a frozen worker too.
        ``processes=False`` leaves out each worker's process state and memory (faster).

        Raises:
            NotAttachedError: the scheme has no stores: no collector (or ``init_on_sender``) set it
                up yet, or its collector shut down. An empty table would read as "no worker".

        Examples:
            >>> scheme = ShmWeightSyncScheme()
            >>> scheme.init_on_sender(model=nn.Linear(3, 1), devices=["cpu"] * 2, model_id="policy")
            >>> len(scheme.readers()), scheme.readers().version  # no worker attached yet
            (0, 0)
            >>> scheme.shutdown()
            >>> scheme.readers()
            Traceback (most recent call last):
            ...
            shmsync.errors.NotAttachedError: ...
        """
        unattached = self.group is None or self.group.closed
        if unattached and self.receiver_side.receiver is None and self.sender_side.remote_kind is None:
            raise NotAttachedError(self._why_unattached("it has no workers to list"))
        tables = [store.readers(processes=processes) for store in self.stores if not store.closed]
        version = max((t.version for t in tables), default=self.version)
        # The nodes' or actors' reports, on the trainer's side of a distributed or Ray collector.
        remote = assemble(self.model_id or "policy", version, [], [], self.remote_rows)
        return merge([*tables, remote])

    def _why_unattached(self, what: str) -> str:
        if self.receiver_side.store_names:  # it had stores (they stay named): its collector or it was shut down since
            return f"this ShmWeightSyncScheme (or its collector) was shut down, so {what}: its stores are gone"
        return (
            f"this ShmWeightSyncScheme is not set up yet, so {what}: hand it to a collector "
            "(weight_sync_schemes={'policy': scheme}) or call scheme.init_on_sender(model=..., devices=...)"
        )

    @property
    def alarm(self) -> ReaderAlarm | None:
        """The stale-worker alarm watching this scheme's workers (trainer side), if started."""
        return self.group.alarm if self.group is not None else None

    def create_transport(self, **kwargs: Any):  # weights travel through a WeightStore
        raise NotSupportedError("ShmWeightSyncScheme moves weights through a WeightStore, not a transport")

    # -- receiver -------------------------------------------------------------------------------
    def _init_on_receiver_impl(
        self, model_id: str, context: Any = None, model: Any = None, worker_idx: int | None = None, **kwargs: Any
    ) -> None:
        names = self.receiver_side.store_names
        if not names:
            raise ShmSyncError("this ShmWeightSyncScheme was never initialized on a sender (no store to attach to)")
        if len(names) > 1 and worker_idx is None:
            raise ShmSyncError("per_worker_weights: the receiver needs its worker_idx to pick its store")
        self.model_id, self.worker_idx = model_id, worker_idx
        if model is not None:
            self.model = model
        if context is not None:
            self.context = context
        name = names[worker_idx if worker_idx is not None and len(names) > 1 else 0]
        self.receiver_side.receiver = Receiver(self, name, self.receiver_side.expected_readers)

    @property
    def context(self) -> Any | None:
        """The collector: the main one on the sender side, the worker's own on the receiver side."""
        return WeightSyncScheme.context.fget(self)

    @context.setter
    def context(self, context: Any) -> None:
        WeightSyncScheme.context.fset(self, context)
        receiver = self.receiver_side.receiver
        if receiver is not None and context is not None:
            receiver.bind(context)  # TorchRL hands the worker's collector over once built: poll before its rollouts

    @property
    def model(self) -> Any | None:
        """The module this scheme loads into (worker side) or was built from (sender side)."""
        if self.receiver_side.receiver is None and self.receiver_side.store_names and self.group is None:
            # A worker's copy of the scheme that TorchRL never set up: it would run its first weights forever.
            raise compat.changed(compat.WORKERS_SET_UP, "TorchRL uses the scheme in a worker it never set it up in")
        return WeightSyncScheme.model.fget(self)

    @model.setter
    def model(self, model: Any) -> None:
        WeightSyncScheme.model.fset(self, model)

    def _setup_connection_and_weights_on_receiver_impl(self, *, worker_idx: int | None = None) -> None:
        self.poll()  # the first load (the policy may still be on the meta device)

    def receive(self, timeout: float | None = None) -> None:
        """Load the newest version if it changed (cheap otherwise). Weights never travel by message."""
        self.poll()

    def poll(self) -> bool:
        """Worker side: reload if a new version was published. True if reloaded."""
        receiver = self.receiver_side.receiver
        return receiver.poll() if receiver is not None else False

    # -- lifetime, and the copies sent to the workers (pickled, by spawn) -----------------------
    def shutdown(self) -> None:
        super().shutdown()
        receiver, self.receiver_side.receiver = self.receiver_side.receiver, None
        if receiver is not None:
            receiver.close()
        group, self.sender_side.group = self.sender_side.group, None
        if group is not None:
            group.close()

    def __getstate__(self) -> dict:
        return self._state_to_send(check=True)

    def __copy__(self) -> Any:
        return self._clone()

    def __deepcopy__(self, memo: dict) -> Any:
        return self._clone(memo)

    def _state_to_send(self, check: bool = False) -> dict:
        """What a copy of this scheme in another process gets: TorchRL's own state (as TorchRL
        pickles it), and of this class's, by name: the settings without the trainer's module and
        alarm function, and what each side sends (its ``SENT``); the trainer's stores, publisher
        and receiver stay here. ``check``: refuse a scheme that no collector initialized."""
        unset = not self.receiver_side.store_names and self.sender_side.remote_kind is None
        if check and unset and not self.initialized_on_receiver:
            raise ShmSyncError(
                "a ShmWeightSyncScheme that no collector initialized is being sent to another process: it is in the "
                "collector_kwargs of one of TorchRL's remote collectors (DistributedSyncCollector, "
                "DistributedCollector, RayCollector), which carry no trainer version to their nodes. Use "
                "shmsync.torchrl.distributed.DistributedSyncCollector, "
                "shmsync.torchrl.distributed.DistributedCollector or shmsync.torchrl.distributed.RayCollector: "
                "the same classes, with each push numbered by the trainer"
            )
        alarm = self.settings.alarm
        if alarm is not None and callable(alarm["on_stale"]):
            alarm = {**alarm, "on_stale": "warn"}  # a function of the trainer's (a lambda) need not travel
        return {
            **WeightSyncScheme.__getstate__(self),
            "settings": dataclasses.replace(self.settings, source=None, alarm=alarm),  # the module stays here
            "sender_side": self.sender_side.sent(),
            "receiver_side": self.receiver_side.sent(),
        }

    def _clone(self, memo: dict | None = None) -> ShmWeightSyncScheme:
        """A copy of this scheme as a worker gets it (``memo``: a deep copy's)."""
        clone = type(self).__new__(type(self))
        if memo is not None:
            memo[id(self)] = clone
        state = self._state_to_send()
        clone.__setstate__(state if memo is None else copy.deepcopy(state, memo))
        return clone

    def serve_remote_nodes(self, kind: str) -> None:
        """Be the local scheme of a remote collector's nodes (``kind``: ``"distributed"`` or
        ``"ray"``): each node publishes the trainer's pushes under the trainer's numbers."""
        self.sender_side.remote_kind = kind


def claim_remote_schemes(collector_kwargs: Any, kind: str, collector_name: str) -> list[ShmWeightSyncScheme]:
    """Mark the :class:`ShmWeightSyncScheme` s in a remote collector's ``collector_kwargs`` (one
    dict, or one per node) as the local schemes of that collector (``kind``: ``"distributed"`` or
    ``"ray"``), before they travel to its nodes or actors."""
    found: list[ShmWeightSyncScheme] = []
    for kw in collector_kwargs if isinstance(collector_kwargs, (list, tuple)) else [collector_kwargs]:
        for scheme in ((kw or {}).get("weight_sync_schemes") or {}).values():
            if isinstance(scheme, ShmWeightSyncScheme) and scheme not in found:
                found.append(scheme)
    if found and compat.TORCHRL_VERSION < (0, 14):
        raise NotSupportedError(
            f"ShmWeightSyncScheme as the local scheme of {collector_name}'s nodes needs torchrl >= 0.14 (this is "
            f"{'.'.join(map(str, compat.TORCHRL_VERSION))}); use TorchRL's own local scheme here"
        )
    for scheme in found:
        scheme.serve_remote_nodes(kind)
    return found


def _register() -> None:
    # "shmsync" among TorchRL's weight-sync backends (torchrl >= 0.14), through its public
    # registry, as TorchRL's own scheme modules register theirs when imported: no import hook, so
    # `import shmsync` alone changes nothing in TorchRL (tests/torchrl/test_compat.py checks it).
    from torchrl.weight_update import weight_sync_schemes

    register = getattr(weight_sync_schemes, "register_weight_sync_backend", None)
    if register is not None:  # torchrl >= 0.14
        register("shmsync")(ShmWeightSyncScheme)


_register()
