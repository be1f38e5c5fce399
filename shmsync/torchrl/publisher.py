"""The one route of every publish of a collector (:class:`Publisher`), and how a scheme finds its
collector's.

A :class:`Publisher` is made when TorchRL gives a scheme its collector (``init_on_sender(context=
collector)``, :func:`~shmsync.torchrl.collector_patches.publisher_and_group`), or by a scheme
initialized before any collector. Every publish goes through :meth:`Publisher.route`, whichever
entry point the user calls: TorchRL's loop calls each scheme's ``send()``, and the collector's
:class:`~shmsync.torchrl.collector_patches.CollectorPatches` wrap its ``update_policy_weights_``
so that the keys one call names are published as one version.

A publish's version is, in order: the one given (``update_policy_weights_(version=n)``); on a
collector that is another process's remote node (a node, a Ray actor), the trainer's number of the
push being applied (:mod:`shmsync.torchrl.remote_nodes`), never a guess; else the store's next.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection
from typing import Any, Protocol

from shmsync.errors import ClosedError, WrittenWhileCopiedError
from shmsync.torchrl import at_exit, compat
from shmsync.torchrl.store_group import StoreGroup, check_all
from shmsync.writer.role import check_version

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

    def route_models(
        self, keys: set[str], *, version: int | None = None, if_changed: bool = False
    ) -> tuple[list[int], list[str]]:
        """Publish the models of ``keys`` into each group's stores (the hand-out's route: see
        :class:`CollectorPatches`), each a new version (under ``version`` if given), or, with
        ``if_changed``, only where they changed since its newest version; the tracker told.
        Returns the versions published, and the keys of the groups whose models another thread
        kept writing while they were copied (those published nothing)."""
        published: list[int] = []
        written: list[str] = []
        for group in [g for g in self.groups if not g.closed]:
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
        groups = [g for g in self.groups if not g.closed and any(k in g.keys for k in keys)]
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


def _promised(groups: list[StoreGroup]) -> list[int]:
    """The newest promised version of each store of the live ``groups`` (what TorchRL's tracker is told)."""
    return [s.promised for g in groups if not g.closed for s in g.stores]


def _to_several(groups: list[StoreGroup], weights: dict[str, Any], worker_ids: Any, version: int | None) -> int:
    """One version in several groups, all checked before any is written; the newest published."""
    parts = [(g, {k: w for k, w in weights.items() if k in g.keys}) for g in groups]
    check_all([pair for g, w in parts for pair in g.prepare(w, worker_ids)], version)
    return max(g.publish_keys(w, worker_ids, version) for g, w in parts)
