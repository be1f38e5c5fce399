"""shmsync's part of one TorchRL collector that a user handed a :class:`~shmsync.ShmWeightSyncScheme`.

A :class:`CollectorGlue` is made when TorchRL gives the scheme its collector
(``init_on_sender(context=collector)``, or the collector's ``connect()`` for a scheme initialized
before it). It holds the collector's groups of stores and decides each publish's version
(:class:`~shmsync.torchrl.push_numbers.VersionSource`), and wraps four public methods on that one
collector instance (TorchRL's class is left alone):

- ``update_policy_weights_``: the shmsync keys the call names are published here, straight into
  their stores, as one version (under ``version=n`` if given, shmsync's own keyword), without
  going through TorchRL's per-key loop; the call goes on to TorchRL for any other key;
- ``shutdown``: frees the stores at once;
- ``load_state_dict``: republishes under the restored versions, so the workers' frames carry them;
- ``iterator``: gives each batch ``("next", key)`` where a worker could not tag it.

Each stands over a path that stays correct without it: bypassed, TorchRL's loop calls each
scheme's ``send()``, which publishes that key at once; the stores are freed with the scheme; the
workers' own tags stand.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from tensordict import TensorDictBase

from shmsync.frames import tag_next
from shmsync.torchrl import compat
from shmsync.torchrl.push_numbers import VersionSource
from shmsync.torchrl.stores import SenderGroup, check_all

_GLUES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # collector -> its glue


class RemoteLeg(Protocol):
    """What a collector that is another process's remote leg reports of each push it applies."""

    def applied(self, version: int) -> None:
        """The push numbered ``version`` is published to this collector's workers."""

    def failed(self, error: BaseException) -> None:
        """The push could not be published: report it to the trainer, or raise it."""


class CollectorGlue:
    """The stores, versions and instance wrappers of one collector.

    Args:
        collector: the TorchRL collector.
        versions: decides each publish's version.
        leg: set when the collector is another process's remote leg (a node, a Ray actor).
    """

    def __init__(self, collector: Any, versions: VersionSource, leg: RemoteLeg | None = None) -> None:
        self._collector = weakref.ref(collector)
        self.versions = versions
        self.leg = leg
        self.groups: list[SenderGroup] = []
        self.keys: set[str] = set()  # the collector's shmsync keys
        self.unchecked: list[SenderGroup] = []  # groups whose workers are still to be seen attached
        self.version_keys: list[str] = []
        self.num_workers = getattr(collector, "num_workers", None)
        self.report_version = compat.version_setter(collector)  # checked now, before any worker starts
        compat.wrap_on_instance(collector, "update_policy_weights_", lambda f: _bind(self.update, f))
        compat.wrap_on_instance(collector, "shutdown", lambda f: _bind(self.shutdown, f))
        compat.wrap_on_instance(collector, "load_state_dict", lambda f: _bind(self.load_state_dict, f))
        compat.wrap_on_instance(collector, "iterator", lambda f: _bind(self.iterator, f))

    @classmethod
    def of(cls, collector: Any) -> CollectorGlue | None:
        """The glue of ``collector``, if it has one."""
        return _GLUES.get(collector)

    @classmethod
    def group_with(cls, collector: Any, key: str) -> SenderGroup | None:
        """The group ``collector`` already made for ``key`` (with its other shmsync keys), if any."""
        glue = _GLUES.get(collector)
        return next((g for g in glue.groups if key in g.keys), None) if glue is not None else None

    @classmethod
    def for_collector(
        cls, collector: Any, versions: Callable[[], VersionSource], leg: RemoteLeg | None = None
    ) -> CollectorGlue:
        """The glue of ``collector``, made on first use."""
        glue = _GLUES.get(collector)
        if glue is None:
            glue = _GLUES[collector] = cls(collector, versions(), leg)
        return glue

    @property
    def collector(self) -> Any:
        return self._collector()

    def add(self, group: SenderGroup, version_key: str | None) -> None:
        """Serve ``group`` (its stores hold this collector's keys)."""
        if group in self.groups:
            return
        self.groups.append(group)
        self.keys.update(group.keys)
        self.unchecked.append(group)  # the first batch or update checks that every worker attached
        if version_key is not None and version_key not in self.version_keys:
            self.version_keys.append(version_key)

    def live_groups(self) -> list[SenderGroup]:
        return [g for g in self.groups if not g.closed]

    # -- publishing -------------------------------------------------------------------------------
    def publish(self, weights: dict[str, Any], worker_ids: Any = None, given: int | None = None) -> None:
        """Publish ``weights`` (key -> weights, or None for the key's model) as one version, whatever
        groups the keys live in (checked all before any is written); then tell the tracker, and the
        trainer if this collector is a remote leg."""
        if self.unchecked and self.leg is None:  # a remote leg applies pushes while still being built
            self._check_attached()
        groups = [g for g in self.groups if not g.closed and any(k in g.keys for k in weights)]
        if not groups:
            return
        try:
            version = self.versions.decide(given)
            if len(groups) == 1:
                groups[0].publish(weights, worker_ids, version)
            else:
                self._publish_in(groups, weights, worker_ids, version)
        except BaseException as error:
            if self.leg is None:
                raise
            self.leg.failed(error)
            return
        newest = max(g.version for g in groups)
        if self.report_version is not None:
            self.report_version(newest)
        if self.leg is not None:
            self.leg.applied(newest)

    @staticmethod
    def _publish_in(groups: list[SenderGroup], weights: dict[str, Any], worker_ids: Any, version: int | None) -> None:
        parts = [(g, {k: w for k, w in weights.items() if k in g.keys}) for g in groups]
        # Several groups: all are checked before any is written.
        check_all([pair for g, w in parts for pair in g.prepare(w, worker_ids)], version)
        for g, w in parts:
            g.publish(w, worker_ids, version)

    def _check_attached(self) -> None:
        """Once per group: every worker's reader attached (TorchRL set the scheme up in each)."""
        while self.unchecked:
            self.unchecked.pop().check_workers_attached()

    def sync_tracker(self) -> None:
        """Make ``track_policy_version``'s tracker report the version last published."""
        groups = self.live_groups()
        if self.report_version is not None and groups:
            self.report_version(max(g.version for g in groups))

    # -- the wrappers -----------------------------------------------------------------------------
    def update(self, original: Callable, *args: Any, version: int | None = None, **kwargs: Any) -> Any:
        """``update_policy_weights_``: the shmsync keys it names, one version; the rest, TorchRL's."""
        weights, worker_ids = compat.update_request(args, kwargs)
        rest = {k: w for k, w in weights.items() if k not in self.keys}
        result = original(weights_dict=rest, worker_ids=worker_ids) if rest else None
        self.publish({k: w for k, w in weights.items() if k in self.keys}, worker_ids, given=version)
        return result

    def shutdown(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(*args, **kwargs)
        finally:
            for g in self.live_groups():
                g.close()

    def load_state_dict(self, original: Callable, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(state_dict, *args, **kwargs)
        saved = [_saved_version(state_dict, i) for i in range(self.num_workers or 0)]
        for g in self.live_groups():
            g.relabel(saved if g.per_worker else [max((v for v in saved if v is not None), default=None)])
        return result

    def iterator(self, original: Callable, *args: Any, **kwargs: Any) -> Iterator[Any]:
        self._check_attached()  # before the first batch: a worker left out would run its first weights
        for batch in original(*args, **kwargs):
            if self.version_keys and isinstance(batch, TensorDictBase):
                for key in self.version_keys:
                    if key in batch.keys() and ("next", key) not in batch.keys(True):
                        tag_next(batch, key)
            yield batch


def _bind(method: Callable, original: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return method(original, *args, **kwargs)

    wrapper.__name__ = getattr(original, "__name__", "wrapper")
    wrapper.__doc__ = getattr(original, "__doc__", None)
    wrapper.__wrapped__ = original
    return wrapper


def _saved_version(state_dict: Any, worker: int) -> int | None:
    worker_state = state_dict.get(f"worker{worker}") if hasattr(state_dict, "get") else None
    version = worker_state.get("policy_version") if hasattr(worker_state, "get") else None
    return int(version) if isinstance(version, (int, torch.Tensor)) and not isinstance(version, bool) else None
