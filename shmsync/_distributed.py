"""shmsync as each host's local leg under TorchRL's distributed collectors (torchrl >= 0.14).

``DistributedSyncCollector`` and ``DistributedCollector`` push the trainer's weights to one node
process per host with a ``DistributedWeightSyncScheme`` (torch.distributed); each node's
collector fans them out to its local workers through the scheme given in
``collector_kwargs["weight_sync_schemes"]``. With a :class:`~shmsync.ShmWeightSyncScheme`
there, three things need help, and get it here:

1. **Receive buffers.** The trainer receives each node's batch into a buffer shaped like a batch
   of its own single-process collector, which has no version keys; a node's batch has two more,
   and gloo aborts on the size mismatch. The buffers get the version keys (and, for
   ``DistributedSyncCollector``, whose nodes' buffers share one memory, a memory per node).
2. **Versions.** TorchRL's push carries no version. The trainer's scheme counts its pushes and
   writes the count into the TCPStore it already uses, before each push; a node publishes what it
   received under that count. A push waits for the nodes' acknowledgements, which come after the
   publish, so the count a node reads is that of the push it received. A node left out of a push
   (``DistributedCollector(sync=False)`` updates only the node that delivered) skips that version.
3. **Start.** A ``DistributedSyncCollector`` node receives pushes before its collector, and so
   its store, exists: a push landing then would be applied to no worker. Each node marks itself
   ready in the TCPStore once its store exists; the trainer waits for every node before its
   first batch.

The collectors and the scheme are wrapped when their modules are imported (see
:mod:`shmsync._registration`); a collector without a shmsync scheme runs TorchRL's code unchanged.
Every TorchRL internal touched here is listed, and checked, in :mod:`shmsync._torchrl_compat`.
"""

from __future__ import annotations

import functools
import time
import weakref
from datetime import timedelta
from typing import Any

import torch

from . import _torchrl_compat as compat

CONTAINER = "Distributed(Sync)Collector._make_container, wrapped, and its receive buffers"
SEND = "DistributedWeightSyncScheme.send, wrapped; ._store, ._store_info, ._worker_idx, ._model_id"
VERSION_KEY = "shmsync/version/{model_id}"
READY_KEY = "shmsync/ready/{rank}"
READY_TIMEOUT_S = 300.0


# -- trainer side ---------------------------------------------------------------------------------
def _is_shmsync(scheme: Any) -> bool:
    # By a class mark, not isinstance: the scheme module imports this one.
    return getattr(type(scheme), "SHMSYNC", False) is True


def local_schemes(kwargs: Any) -> list[Any]:
    """The shmsync schemes among the nodes' local schemes, given a distributed collector's
    ``collector_kwargs`` (one dict, or one per node)."""
    found = []
    for kw in kwargs if isinstance(kwargs, (list, tuple)) else [kwargs]:
        for scheme in ((kw or {}).get("weight_sync_schemes") or {}).values():
            if _is_shmsync(scheme) and scheme not in found:
                found.append(scheme)
    return found


def _without_local_schemes(kw: dict) -> dict:
    """``kw`` for the trainer's own single-process probe collector: shmsync syncs no process there."""
    kw = dict(kw)
    schemes = {k: s for k, s in (kw.get("weight_sync_schemes") or {}).items() if not _is_shmsync(s)}
    if schemes:
        kw["weight_sync_schemes"] = schemes
    else:
        kw.pop("weight_sync_schemes", None)
    return kw


def _add_version_keys(collector: Any, keys: list[Any]) -> None:
    """Give the trainer's receive buffers the version keys the nodes' batches carry."""

    def add(td: Any) -> None:
        td.unlock_()
        for key in keys:
            td.set(key, torch.zeros(td.batch_size, dtype=torch.int64, device=td.device))
        td.lock_()

    compat.check(
        CONTAINER,
        any(hasattr(collector, a) for a in ("_single_tds", "_tensordict_out_unbind", "_tensordict_out")),
        f"{type(collector).__name__} has no _tensordict_out receive buffer",
    )
    if hasattr(collector, "_single_tds"):  # DistributedSyncCollector: one buffer, viewed per node
        # TorchRL expands one probe batch, so every node's view is the same memory (stride 0)
        # and the nodes' batches overwrite each other: a frame's tag could then come from one
        # node and its data from the other. Each node gets memory of its own.
        collector._tensordict_out = collector._tensordict_out.clone()
        add(collector._tensordict_out)
        collector._single_tds = collector._tensordict_out.unbind(0)
    elif hasattr(collector, "_tensordict_out_unbind"):  # DistributedCollector(sync=True): a lazy stack
        for td in collector._tensordict_out_unbind:
            add(td)
    else:  # DistributedCollector(sync=False): one buffer per node
        for td in collector._tensordict_out:
            add(td)


# The trainer's distributed schemes that count their pushes: scheme -> [TCPStore key, pushes so far].
_COUNTING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _count_versions(collector: Any) -> None:
    """Make the trainer's distributed schemes write their push count before each push."""
    for model_id, scheme in compat.schemes_of(collector).items():
        store = getattr(scheme, "_store", None)
        if isinstance(store, torch.distributed.Store):
            key = VERSION_KEY.format(model_id=model_id)
            _COUNTING[scheme] = [key, 0]
            store.set(key, b"0")


def _wait_until_ready(collector: Any) -> None:
    """Block until every node's store exists (a push before that would reach no worker)."""
    stores = [s._store for s in compat.schemes_of(collector).values() if hasattr(s, "_store")]
    if not stores:
        return
    store = stores[0]
    ranks = list(range(1, collector.num_workers + 1))
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        waiting = [r for r in ranks if not store.check([READY_KEY.format(rank=r)])]
        if not waiting:
            return
        dead = [r for r in waiting if not _node_alive(collector, r)]
        if dead or time.monotonic() > deadline:
            why = f"node(s) {dead} exited" if dead else f"node(s) {waiting} not ready after {READY_TIMEOUT_S:.0f} s"
            raise RuntimeError(
                f"{type(collector).__name__}: {why} before their shmsync store existed; see the node's output"
            )
        time.sleep(0.02)


def _node_alive(collector: Any, rank: int) -> bool:
    jobs = getattr(collector, "jobs", None) or []
    job = jobs[rank - 1] if rank - 1 < len(jobs) else None
    is_alive = getattr(job, "is_alive", None)
    return is_alive() if callable(is_alive) else True


def _wrap_make_container(cls: type, *, wait_until_ready: bool) -> None:
    original = cls._make_container
    if getattr(original, "_shmsync", False):
        return

    @functools.wraps(original)
    def _make_container(self: Any) -> None:
        local = local_schemes(self.collector_kwargs)
        if not local:
            return original(self)
        kwargs = self.collector_kwargs
        if isinstance(kwargs, (list, tuple)):
            self.collector_kwargs = [_without_local_schemes(kw) for kw in kwargs]
        try:
            original(self)
        finally:
            self.collector_kwargs = kwargs
        names = list(dict.fromkeys(s.version_key for s in local if s.version_key))
        _add_version_keys(self, [k for name in names for k in (name, ("next", name))])
        _count_versions(self)
        if wait_until_ready:
            _wait_until_ready(self)

    _make_container._shmsync = True
    cls._make_container = _make_container


def _wrap_send(cls: type) -> None:
    original = cls.send
    if getattr(original, "_shmsync", False):
        return

    @functools.wraps(original)
    def send(self: Any, weights: Any = None, worker_ids: Any = None) -> None:
        counting = _COUNTING.get(self)
        if counting is not None:
            counting[1] += 1
            self._store.set(counting[0], str(counting[1]).encode())
        return original(self, weights, worker_ids)

    send._shmsync = True
    cls.send = send


def _refuse(cls: type) -> None:
    """Before torchrl 0.14 the nodes' receive path differs, and frames could be tagged with a
    version whose weights did not act: refuse a shmsync local scheme before any node starts."""
    init = cls.__init__
    if getattr(init, "_shmsync", False):
        return

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if local_schemes(kwargs.get("collector_kwargs")):
            raise NotImplementedError(
                f"ShmWeightSyncScheme as the local scheme of {cls.__name__}'s nodes needs torchrl >= 0.14 "
                f"(this is {'.'.join(map(str, compat.TORCHRL_VERSION))}); use TorchRL's own local scheme here"
            )
        init(self, *args, **kwargs)

    __init__._shmsync = True
    cls.__init__ = __init__


def _patch(module: Any, names: tuple[str, ...], *, wait_until_ready: bool) -> None:
    for name in names:
        cls = getattr(module, name, None)
        if isinstance(cls, type) and hasattr(cls, "_make_container"):
            if compat.TORCHRL_VERSION >= (0, 14):
                _wrap_make_container(cls, wait_until_ready=wait_until_ready)
            else:
                _refuse(cls)


def patch_sync_module(module: Any) -> None:
    """``torchrl.collectors.distributed.sync`` was imported: wrap ``DistributedSyncCollector``."""
    _patch(module, ("DistributedSyncCollector",), wait_until_ready=True)


def patch_generic_module(module: Any) -> None:
    """``torchrl.collectors.distributed.generic`` was imported: wrap ``DistributedCollector``
    (its nodes set up their collector before they receive)."""
    _patch(module, ("DistributedCollector",), wait_until_ready=False)


def patch_scheme_module(module: Any) -> None:
    """``torchrl.weight_update._distributed`` was imported: count pushes where asked to."""
    cls = getattr(module, "DistributedWeightSyncScheme", None)
    if isinstance(cls, type) and hasattr(cls, "send"):
        _wrap_send(cls)


# -- node side ------------------------------------------------------------------------------------
def _upstream(collector: Any) -> list[Any]:
    """The distributed schemes ``collector`` receives the trainer's pushes from (on a node)."""
    return [
        s
        for s in compat.receiver_schemes(collector).values()
        if isinstance(getattr(s, "_store", None), torch.distributed.Store) and getattr(s, "_worker_idx", None)
    ]


@functools.cache
def _client(host: str, port: int) -> torch.distributed.Store:
    # The node's scheme blocks its own connection in a long get() from its receiving thread.
    return torch.distributed.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))


def _client_of(scheme: Any) -> torch.distributed.Store | None:
    info = getattr(scheme, "_store_info", None)
    compat.check(SEND, isinstance(info, dict), f"{type(scheme).__name__}._store_info is {type(info).__name__}")
    return _client(str(info["host"]), int(info["port"]))


def mark_ready(collector: Any) -> None:
    """Node side: this collector's store exists; tell the trainer (a no-op off a distributed node)."""
    for scheme in _upstream(collector):
        _client_of(scheme).set(READY_KEY.format(rank=scheme._worker_idx), b"1")


def pushed_version(collector: Any, model_id: str | None) -> int | None:
    """Node side: the trainer's version of the push being applied. On a distributed node every
    update is the cascade of a push (nothing else runs there), numbered by the trainer in the
    TCPStore before it pushed; None off a node, or if the trainer counts no versions."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None  # not a node (the cheap answer for every update off one)
    for scheme in _upstream(collector):
        key = VERSION_KEY.format(model_id=model_id or getattr(scheme, "_model_id", None) or "policy")
        client = _client_of(scheme)
        return int(client.get(key)) if client.check([key]) else None
    return None
