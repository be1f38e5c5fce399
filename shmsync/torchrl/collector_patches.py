"""shmsync's wrappers on one collector's instance (:class:`CollectorPatches`), each over a public
method of TorchRL's: TorchRL's class is left alone, and each wrapper stands over a path that stays
correct without it (bypassed, TorchRL's loop calls each scheme's ``send()``, which takes the same
route). Why each is wrapped: the docs' Architecture page.

* ``update_policy_weights_``: the keys one call names are published as one version (TorchRL
  offers no hook around one update call, and drops unknown keywords such as ``version=``), now or
  at the next hand-out of work (:mod:`shmsync.torchrl.freshness` says which);
* ``iterator``: the hand-out before each batch, and ``("next", key)`` where a worker could not tag it;
* ``shutdown`` (frees the stores at once), ``state_dict`` (an update waiting for its hand-out
  published first), ``load_state_dict`` (republishes under the restored versions), and, on
  torchrl 0.15, ``worker_policy_versions`` (answered from the readers' table).

:func:`publisher_and_group` gives a scheme its collector's publisher and group, making both (and
these wrappers) at the first scheme of the collector.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from tensordict import TensorDictBase

from shmsync.errors import ArgumentTypeError, InvalidArgumentError
from shmsync.store.reader_table import merge
from shmsync.torchrl import compat
from shmsync.torchrl.freshness import HandOuts
from shmsync.torchrl.publisher import Publisher, RemotePushes
from shmsync.torchrl.settings import SchemeSettings
from shmsync.torchrl.store_group import StoreGroup, group_for
from shmsync.watch.frames import tag_next


class CollectorPatches:
    """shmsync's wrappers on one collector's instance (see the module's notes for why each is
    wrapped): the update call goes to the collector's :class:`~shmsync.torchrl.publisher.Publisher`,
    now or at the next hand-out, as its :class:`~shmsync.torchrl.freshness.HandOuts` decide.

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
        self.hand_outs = HandOuts(publisher, collector)
        self._collector = weakref.ref(collector)

    def install(self) -> None:
        """Wrap each method of :attr:`WRAPPED` the collector has on its instance."""
        collector = self._collector()
        for method in self.WRAPPED:
            if method != "worker_policy_versions" or compat.has_worker_versions(collector):
                compat.wrap_on_instance(collector, method, functools.partial(_bind, getattr(self, method)))

    # -- the wrappers, each named as the collector's method it wraps ------------------------------
    def update_policy_weights_(self, original: Callable, *args: Any, version: int | None = None, **kwargs: Any) -> Any:
        """The shmsync keys it names, one version (now, or at the next hand-out); the rest, TorchRL's."""
        keys = self.publisher.keys
        weights, worker_ids = compat.update_request(args, kwargs) if args or kwargs else ({"policy": None}, None)
        rest = {k: w for k, w in weights.items() if k not in keys}
        result = original(weights_dict=rest, worker_ids=worker_ids) if rest else None
        self.hand_outs.update({k: w for k, w in weights.items() if k in keys}, worker_ids, version)
        return result

    def shutdown(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        """TorchRL's shutdown, then the stores freed at once (else they go with the schemes); an
        update waiting for a hand-out goes with the workers."""
        self.hand_outs.drop()
        try:
            return original(*args, **kwargs)
        finally:
            for g in self.publisher.live_groups():
                g.close()

    def state_dict(self, original: Callable, *args: Any, **kwargs: Any) -> Any:
        """TorchRL's state, with an update this thread made that waits for its hand-out published
        first: the workers report the weights and the version the trainer sent them."""
        self.hand_outs.publish_due(threading.get_ident())
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
        """Each batch of TorchRL's iterator, handed out as :meth:`HandOuts.batches` says; each gets
        ``("next", key)`` where a worker could not tag it."""
        self.publisher.check_attached()  # before the first batch: a worker left out would run its first weights
        version_keys = self.publisher.version_keys
        # Closed with this generator (a `break`): the hand-outs then publish what still waits.
        with contextlib.closing(self.hand_outs.batches(original(*args, **kwargs))) as batches:
            for batch in batches:
                if version_keys and isinstance(batch, TensorDictBase):
                    for key in version_keys:
                        if batch.get(("next", key), None) is None and key in batch.keys():
                            tag_next(batch, key)
                yield batch


def _bind(method: Callable, original: Callable) -> Callable:
    """``method(original, ...)`` as the instance's method (a C partial: no frame of its own)."""
    wrapper = functools.partial(method, original)
    functools.update_wrapper(wrapper, original)
    return wrapper


def _saved_version(state_dict: Any, worker: int) -> int | None:
    worker_state: Any = state_dict.get(f"worker{worker}") if hasattr(state_dict, "get") else None
    version = worker_state.get("policy_version") if hasattr(worker_state, "get") else None
    return int(version) if isinstance(version, (int, torch.Tensor)) and not isinstance(version, bool) else None


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
