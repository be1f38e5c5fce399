"""``ShmWeightSyncScheme``: TorchRL's multi-process collectors on shmsync stores.

Sender (main process): the collector's models for every key that uses this scheme go
into one :class:`~shmsync.WeightStore` (one per worker with ``per_worker_weights``);
``update_policy_weights_()`` publishes into it and returns, with no message to and no
acknowledgement from any worker. All keys sent by one ``update_policy_weights_`` call are
published together as one version.

Receiver (each worker): attaches, loads the first weights into the (meta-device) policy,
then checks the version before every rollout and at every policy call, and reloads only when
it changed: whatever path TorchRL takes to run the policy, its next call runs the newest
version. Each frame is tagged with the version of the weights that produced it, and TorchRL's
``track_policy_version`` reports that version. Once every worker has attached, the store's name
leaves the host: nothing can leak it, whatever kills the processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tensordict import TensorDictBase
from torch import nn
from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme

from shmsync.alarm import STALE_AFTER, ReaderAlarm, StaleEvent, check_settings
from shmsync.store import WeightStore
from shmsync.table import ReaderTable, assemble, merge
from shmsync.torchrl import compat
from shmsync.torchrl.glue import CollectorGlue
from shmsync.torchrl.legs import make_leg
from shmsync.torchrl.models import models_without_collector
from shmsync.torchrl.push_numbers import VersionSource
from shmsync.torchrl.receiver import Receiver, WorkerSide
from shmsync.torchrl.stores import SenderGroup, group_for


class ShmWeightSyncScheme(WorkerSide, WeightSyncScheme):
    """Weight sync for ``MultiSyncCollector`` / ``MultiAsyncCollector`` through shared memory.

    Workers never see half-written weights (each reload is one complete version), the
    trainer never waits for workers, and workers run only published versions: an in-place
    edit of the trainer's parameters reaches no worker until it is published. CPU workers
    share the published memory (no copy of the weights per worker); GPU workers copy it
    into their device.

    Every way TorchRL initializes a scheme works: by the collector (the usual way), or
    before any collector exists with ``init_on_sender(model=..., devices=...)``,
    ``init_on_sender(weights=..., devices=...)`` or ``init_on_sender(params_map={worker:
    weights})``. A collector built from ``policy_factory`` alone takes the weights' layout
    from the factory's model, built once in the main process.

    Args:
        poll_every_steps: check for new weights at every this many-th policy call (and before
            each rollout). Default: at every call (a version check: see the Performance page).
        version_key: the key under which every collected frame records the version of the
            weights that produced it (also written under ``("next", version_key)``); None
            to write nothing.
        num_slots: slots of shared memory (see :meth:`WeightStore.create`); a slot holds memory
            only while it holds a version someone uses. Default: 4, so that every worker of a
            ``MultiSyncCollector`` runs in place across a version change; a
            ``MultiAsyncCollector`` needs ``workers + 2`` for all of them to (up to 16).
        zero_copy: CPU workers run their policy on the store's shared memory in place (see
            :class:`~shmsync.WeightReader`): a reload copies nothing, and no worker holds a copy
            of the weights of its own. Default (None): on CPU workers, yes; workers on a GPU
            copy into their device, always. False gives every worker a private copy: for a
            policy that writes its own parameters (in place, such a write raises
            :class:`~shmsync.errors.SharedWeightsWrittenError` at the next reload).
        source: the trainer-side module for this key, when the collector cannot resolve it in
            the main process (say, a key such as ``"env.transform[0]"`` that names a module
            that exists only inside each worker). Default: ``collector.get_model(key)``, or
            for ``"policy"`` without a policy, a model from the collector's ``policy_factory``.
        per_worker_weights: give each worker its own weights and versions (one store per
            worker), as TorchRL's argument of that name does:
            ``update_policy_weights_({worker: weights})`` and ``worker_ids=`` then publish to
            those workers only. Turned on by itself when a collector's ``policy_factory`` is a
            list of distinct factories and it has no policy. Without it, an update aimed at some
            workers only raises: all workers load one set of weights.
        stale_after: seconds a worker may run at a version older than the newest publish (loading
            nothing newer) before the stale-worker alarm names it (see :mod:`shmsync.alarm`): a
            worker between rollouts is named only if its process is stopped. None turns this
            limit off. Default: 30.
        max_lag: versions a running worker may fall behind before the alarm names it (None: no
            limit, the default; versions are the trainer's numbers).
        on_stale: what the alarm does: ``"warn"`` (log a warning, the default), ``"raise"`` (log,
            and raise :class:`~shmsync.errors.StaleReaderError` at the next
            ``update_policy_weights_()``), a function called with each
            :class:`~shmsync.alarm.StaleEvent`, or None for no alarm.
        strategy: TorchRL's weight-extraction strategy name (kept for compatibility; weights
            always travel as tensors in shared memory).

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
        source: nn.Module | None = None,
        per_worker_weights: bool = False,
        stale_after: float | None = STALE_AFTER,
        max_lag: int | None = None,
        on_stale: str | Callable[[StaleEvent], Any] | None = "warn",
        strategy: str = "tensordict",
    ) -> None:
        super().__init__(strategy)
        if on_stale is not None:
            check_settings(stale_after, max_lag, on_stale)
        self.alarm_settings = (
            None if on_stale is None else {"stale_after": stale_after, "max_lag": max_lag, "on_stale": on_stale}
        )
        if source is not None and not isinstance(source, nn.Module):
            raise TypeError(f"source must be an nn.Module, got {type(source).__name__}")
        self.source = source
        if poll_every_steps is not None and poll_every_steps < 1:
            raise ValueError(f"poll_every_steps must be >= 1 or None, got {poll_every_steps}")
        self.poll_every_steps = poll_every_steps
        self.version_key = version_key
        self.zero_copy = zero_copy
        self.num_slots = num_slots if num_slots is not None else 4
        self.per_worker_weights = per_worker_weights
        self._store_names: list[str] = []
        self._expected_readers: int | None = None
        self._group: SenderGroup | None = None
        self._receiver: Receiver | None = None
        self._leg: str | None = None  # "distributed" / "ray": the local leg of shmsync's remote collector
        self._served = False  # a collector's glue serves the group

    # -- sender ---------------------------------------------------------------------------------
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
        if context is not None:
            given = {"model": model, "weights": weights, "params_map": params_map, "devices": devices}
            given["device_map_fn"] = device_map_fn
            extra = [k for k, v in given.items() if v is not None]
            if extra:
                raise ValueError(f"init_on_sender(context=...) takes model_id only, not {extra}")
            if model_id is None:
                raise ValueError("init_on_sender(context=...) needs model_id")
            self.model_id = model_id
            self.context = context
            if self._leg is not None and not hasattr(context, "num_workers"):
                return  # the trainer's single-process probe of a distributed collector: nothing to sync
            self._group = self._join(context)
        else:
            self.model_id = model_id if model_id is not None else "policy"
            models, workers, self.per_worker_weights = models_without_collector(
                self.per_worker_weights, model, weights, params_map, devices, device_map_fn, num_workers
            )
            self._group = SenderGroup(
                [{self.model_id: m} for m in models], num_slots=self.num_slots, num_workers=workers, devices=devices
            )
        self._store_names = self._group.store_names
        self._expected_readers = self._group.expected_readers()
        self._group.start_alarm(self.alarm_settings)

    def _join(self, collector: Any) -> SenderGroup:
        """The group of ``collector`` that holds this key; made for all its shmsync keys at once."""
        served = CollectorGlue.group_with(collector, self.model_id)
        if served is not None:
            self._served = True
            return served
        if not hasattr(collector, "num_workers"):
            raise TypeError(
                f"ShmWeightSyncScheme syncs the worker processes of a multi-process collector "
                f"(MultiSyncCollector, MultiAsyncCollector); {type(collector).__name__} runs the trainer's "
                "policy in this process, so there is nothing to sync: drop weight_sync_schemes there "
                "(shmsync.tag_versions(policy, ...) tags its frames if you need versions)"
            )
        schemes = {
            k: s
            for k, s in compat.schemes_of(collector).items()
            if isinstance(s, ShmWeightSyncScheme) and s._group is None
        }
        schemes[self.model_id] = self
        group = group_for(collector, schemes, self.num_slots)
        try:
            self._serve(collector, group)
        except BaseException:
            group.close()
            raise
        return group

    def _serve(self, collector: Any, group: SenderGroup) -> None:
        """Make ``group`` the stores of ``collector``'s shmsync keys."""
        if group.per_worker and getattr(collector, "num_workers", group.num_workers) != group.num_workers:
            raise ValueError(
                f"this scheme holds per-worker weights for {group.num_workers} workers, "
                f"the collector has {collector.num_workers}"
            )
        leg = make_leg(self._leg, collector, self.model_id) if self._leg is not None else None
        glue = CollectorGlue.for_collector(collector, lambda: VersionSource(leg), leg)
        glue.add(group, self.version_key)
        self._served = True
        if glue.leg is not None:
            glue.leg.started()

    def _setup_connection_and_weights_on_sender_impl(self, *, worker_idx: int | None = None, weights: Any = None):
        if self._group is None:
            return  # the trainer's probe of a distributed collector
        # Initialized before the collector existed: the collector calling connect() is ours.
        if not self._served:
            self._serve(compat.collector_connecting(self), self._group)
        # The store already holds the initial weights: workers load them on their own.
        if weights is not None:
            self.send(weights)

    def send(self, weights: Any = None, worker_ids: Any = None) -> None:
        """Publish ``weights`` for this key (default: the model the scheme was built from), at once.

        Returns as soon as the store holds the new version. ``weights`` may be a module, a
        TensorDict, a state dict, or ``{worker index: weights}`` with ``per_worker_weights``;
        ``worker_ids`` (ints or devices) limits the update to those workers, which needs
        ``per_worker_weights`` unless it names them all. (``collector.update_policy_weights_()``
        publishes every shmsync key it names as one version, without calling this.)
        """
        if self._group is None:
            raise RuntimeError("ShmWeightSyncScheme.send() needs init_on_sender() first (pass it to a collector)")
        glue = CollectorGlue.of(self.context) if self._served and self.context is not None else None
        if glue is not None:
            glue.publish({self.model_id: weights}, worker_ids)
        else:
            self._group.publish({self.model_id: weights}, worker_ids)

    @property
    def stores(self) -> tuple[WeightStore, ...]:
        """Sender: every store (one, or one per worker). Receiver: this worker's store."""
        if self._group is not None:
            return tuple(self._group.stores)
        if self._receiver is not None:
            return (self._receiver.store,)
        return ()

    @property
    def store(self) -> WeightStore | None:
        """The store (sender side or worker side), or None before initialization.

        Raises:
            ValueError: with ``per_worker_weights`` on the sender side (see :attr:`stores`).
        """
        stores = self.stores
        if len(stores) > 1:
            raise ValueError("per_worker_weights: one store per worker, see ShmWeightSyncScheme.stores")
        return stores[0] if stores else None

    @property
    def version(self) -> int:
        """Sender: the last published version (the newest of any worker's). Receiver: the version
        loaded in this worker. -1 before initialization."""
        if self._receiver is not None:
            return self._receiver.version
        return max((s.version for s in self.stores), default=-1)

    @property
    def versions(self) -> list[int]:
        """Sender: the last published version of each store (one per worker with
        ``per_worker_weights``)."""
        return [s.version for s in self.stores]

    def readers(self, *, processes: bool = False) -> ReaderTable:
        """The readers' table of this scheme: on the trainer, every worker of the collector (each
        store's, and the nodes' or actors' of a distributed or Ray collector, as they last
        reported); in a worker, its store's. Sends no message, never waits for a worker: it works
        mid-rollout, with a frozen worker too. See :mod:`shmsync.table`.

        Args:
            processes: also look up each local worker's process state and private memory (USS).

        Examples:
            >>> scheme = ShmWeightSyncScheme()
            >>> scheme.init_on_sender(model=nn.Linear(3, 1), devices=["cpu"] * 2, model_id="policy")
            >>> len(scheme.readers()), scheme.readers().latest  # no worker attached yet
            (0, 0)
            >>> scheme.shutdown()
        """
        tables = [store.readers(processes=processes) for store in self.stores if not store.closed]
        latest = max((t.latest for t in tables), default=self.version)
        # The nodes' or actors' reports, on the trainer's side of a distributed or Ray collector.
        remote = assemble(getattr(self, "model_id", None) or "policy", latest, [], [], self)
        return merge([*tables, remote])

    @property
    def alarm(self) -> ReaderAlarm | None:
        """The stale-worker alarm watching this scheme's workers (trainer side), if started."""
        return self._group.alarm if self._group is not None else None

    def create_transport(self, **kwargs: Any):
        raise NotImplementedError("ShmWeightSyncScheme moves weights through a WeightStore, not a transport")

    # -- lifetime -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        super().shutdown()
        receiver, self._receiver = getattr(self, "_receiver", None), None
        if receiver is not None:
            receiver.close()
        group, self._group = getattr(self, "_group", None), None
        if group is not None:
            group.close()


def claim_remote_legs(collector_kwargs: Any, kind: str, collector_name: str) -> list[ShmWeightSyncScheme]:
    """Mark the :class:`ShmWeightSyncScheme` s in a remote collector's ``collector_kwargs`` (one
    dict, or one per node) as the local legs of that collector (``kind``: ``"distributed"`` or
    ``"ray"``), before they travel to its nodes or actors."""
    found: list[ShmWeightSyncScheme] = []
    for kw in collector_kwargs if isinstance(collector_kwargs, (list, tuple)) else [collector_kwargs]:
        for scheme in ((kw or {}).get("weight_sync_schemes") or {}).values():
            if isinstance(scheme, ShmWeightSyncScheme) and scheme not in found:
                found.append(scheme)
    if found and compat.TORCHRL_VERSION < (0, 14):
        raise NotImplementedError(
            f"ShmWeightSyncScheme as the local scheme of {collector_name}'s nodes needs torchrl >= 0.14 (this is "
            f"{'.'.join(map(str, compat.TORCHRL_VERSION))}); use TorchRL's own local scheme here"
        )
    for scheme in found:
        scheme._leg = kind
    return found


def _register() -> None:
    # The class itself replaces the stand-in `import shmsync` put into TorchRL's registry.
    from torchrl.weight_update import weight_sync_schemes

    register = getattr(weight_sync_schemes, "register_weight_sync_backend", None)
    if register is not None:  # torchrl >= 0.14
        register("shmsync")(ShmWeightSyncScheme)


_register()
