"""TorchRL's collectors for several hosts with shmsync as each host's local scheme.

:class:`DistributedSyncCollector`, :class:`DistributedCollector` and :class:`RayCollector` are
TorchRL's classes of those names (``torchrl.collectors.distributed``), subclassed: they take the
same arguments and behave the same, and with a :class:`~shmsync.ShmWeightSyncScheme` in
``collector_kwargs["weight_sync_schemes"]`` they also

- **number each push** of the trainer's weights, so that every frame on every host carries the
  trainer's version (whichever nodes or actors a push reaches), and each host's workers load
  every push at once, through shared memory;
- **check each push landed**: after it, every node or actor it reached must have published it to
  its workers, else :class:`~shmsync.torchrl.compat.TorchRLChangedError` names what TorchRL
  stopped doing; nothing runs stale quietly;
- (``DistributedSyncCollector``, ``DistributedCollector``) give the trainer's receive buffers the
  version keys the nodes' batches carry, and each node memory of its own.

TorchRL's own classes hand a scheme in ``collector_kwargs`` nothing on the trainer's side, so
this is done here, by subclassing, rather than by changing TorchRL's classes. TorchRL's own
classes with a shmsync local scheme are refused with an error that names these.

Examples:
    >>> from shmsync import ShmWeightSyncScheme
    >>> from shmsync.torchrl.distributed import DistributedSyncCollector
    >>> collector = DistributedSyncCollector(  # doctest: +SKIP
    ...     [make_env] * 2, policy, frames_per_batch=256, total_frames=2048,
    ...     collector_class=MultiSyncCollector, num_workers_per_collector=2,
    ...     collector_kwargs={"weight_sync_schemes": {"policy": ShmWeightSyncScheme()}},
    ...     launcher="mp",
    ... )
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torchrl.collectors import distributed as torchrl_distributed

from shmsync.errors import ShmSyncError
from shmsync.store.reader_table import HostReport, ReaderRow
from shmsync.torchrl import compat
from shmsync.torchrl.push_deltas import NodeTransports, TrainerLeaves
from shmsync.torchrl.remote_nodes import (
    ERROR,
    PUBLISHED_KEY,
    PUSH_KEY,
    READERS_KEY,
    READY_KEY,
    decode_report,
    name_push,
    published_version,
    shut_down,
)
from shmsync.torchrl.scheme import claim_remote_schemes
from shmsync.watch.remote_rows import ReportBook

log = logging.getLogger("shmsync.torchrl.distributed")
READY_TIMEOUT_S = 60.0  # how long the first push waits for every node's store
CONFIRM_TIMEOUT_S = 60.0  # how long the trainer waits for the actors' answers after a push
EXIT_TIMEOUT_S = 10.0  # how long the actors have to shut down and exit before they are killed


class _NumberedPushes:
    """Trainer side of shmsync's distributed collectors: each push of the trainer's distributed
    schemes is numbered in their TCPStore before it is sent, and confirmed by every node it
    reached after it returns (TorchRL's push waits for the nodes' acknowledgements, which come
    after they applied it)."""

    def __init__(self, collector: Any, *, wait_until_ready: bool, leaves: dict[int, TrainerLeaves]) -> None:
        self.collector = collector
        self.numbered = 0  # pushes numbered: the last may still be on its way
        self.confirmed = 0  # the newest push every node it was sent to confirmed: a complete version
        self.failed = False  # shmsync raised: the nodes are to be stopped, not waited for
        self.waiting = wait_until_ready
        self.stores: list[torch.distributed.Store] = []
        self.leaves = leaves  # by id of the scheme: what each push sends each node
        for scheme in compat.schemes_of(collector).values():
            store = compat.push_store(scheme)
            store.set(PUSH_KEY, "0")
            self.stores.append(store)
            send = functools.partial(_bound, self.push, store, leaves.get(id(scheme)))
            compat.wrap_push(scheme, send)
        self.ranks = list(range(1, collector.num_workers + 1))
        self.book = ReportBook(version=lambda: self.confirmed)
        self._seen: dict[int, int] = {}  # rank -> the number of its last report taken
        self._looked = 0.0

    # -- the nodes' readers ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The newest push every node it was sent to confirmed (a push on its way counts once confirmed)."""
        return self.confirmed

    def remote_rows(self, store_version: int) -> tuple[list[HostReport], list[ReaderRow]]:
        """The nodes' last reports (``shmsync.store.reader_table.RemoteRows``): read from the TCPStore, where each
        node rewrites its table about once a second, at most twice a second; never a message to a node."""
        now = time.monotonic()
        if now - self._looked > 0.5 and self.stores:
            self._looked = now
            store = self.stores[0]
            for rank in self.ranks:
                key = READERS_KEY.format(rank=rank)
                try:
                    if not store.check([key]):
                        continue
                    seq, entries = decode_report(store.get(key))
                except (ValueError, RuntimeError) as e:
                    log.warning("shmsync: ignored node %s's readers' report: %s", rank, e)
                    continue
                if self._seen.get(rank) != seq:
                    self._seen[rank] = seq
                    self.book.heard(entries[0].node if entries else f"rank{rank}", f"node {rank}", entries)
        return self.book.remote_rows(store_version)

    def push(
        self,
        store: torch.distributed.Store,
        leaves: TrainerLeaves | None,
        send: Callable,
        weights: Any = None,
        worker_ids: Any = None,
    ) -> Any:
        self.wait_until_ready()
        self.numbered += 1
        number = self.numbered
        store.set(PUSH_KEY, str(number))
        if leaves is not None:
            leaves.begin(number)
        result = send(weights=weights, worker_ids=worker_ids)
        problems = []
        for rank in self._ranks(worker_ids):
            answer = _read(store, PUBLISHED_KEY.format(rank=rank))
            if leaves is not None:  # the node's buffer holds this push, or nothing known
                leaves.confirmed(rank, number, answer == str(number))
            if answer != str(number):
                problems.append(f"node {rank} answered {answer!r} for push {number}")
        self._confirmed(problems)  # raises where a node did not confirm it
        self.confirmed = number
        return result

    def _confirmed(self, problems: list[str]) -> None:
        self.failed = self.failed or bool(problems)
        compat.check_push_confirmed(problems)

    def check_reports(self) -> None:
        """No node reported a push it could not number (a push that went around :meth:`push`)."""
        for store in self.stores[:1]:
            reports = [(rank, _read(store, PUBLISHED_KEY.format(rank=rank))) for rank in self.ranks]
            self._confirmed([f"node {r} answered {a!r}" for r, a in reports if (a or "").startswith(ERROR)])

    def wait_until_ready(self) -> None:
        """Once, before the first push: every node's store exists (a push before would reach no worker)."""
        if not self.waiting:
            return
        store = self.stores[0]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            waiting = [r for r in self.ranks if not store.check([READY_KEY.format(rank=r)])]
            if not waiting:
                self.waiting = False
                return
            nodes = compat.node_processes(self.collector)
            dead = [r for r in waiting if nodes is not None and r - 1 < len(nodes) and not nodes[r - 1].is_alive()]
            if dead or time.monotonic() > deadline:
                self.failed = True
                why = f"node(s) {dead} exited" if dead else f"node(s) {waiting} not ready after {READY_TIMEOUT_S:.0f} s"
                raise ShmSyncError(
                    f"{type(self.collector).__name__}: {why} before their shmsync store existed; see the node's output"
                )
            time.sleep(0.02)

    def _ranks(self, worker_ids: Any) -> list[int]:
        if worker_ids is None:
            return self.ranks
        ids = worker_ids if isinstance(worker_ids, (list, tuple)) else [worker_ids]
        return [int(i) + 1 for i in ids]


def _read(store: torch.distributed.Store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


def _bound(method: Callable, store: Any, leaves: TrainerLeaves | None, send: Callable) -> Callable:
    def send_numbered(weights: Any = None, worker_ids: Any = None) -> Any:
        return method(store, leaves, send, weights, worker_ids)

    return send_numbered


def _add_version_keys(collector: Any, keys: list[str]) -> None:
    """Give the trainer's receive buffers the version keys the nodes' batches carry."""

    def add(td: Any) -> None:
        for key in keys:
            for where in (key, ("next", key)) if "next" in td.keys() else (key,):
                td.set(where, torch.zeros(td.batch_size, dtype=torch.int64, device=td.device))

    compat.extend_receive_buffers(collector, add)


class _Nodes:
    """What shmsync adds to one of TorchRL's two torch.distributed collectors: its local schemes told
    where the trainer's push store listens before the nodes start, the version keys in the
    trainer's receive buffers, each push numbered and confirmed, and nodes stopped for good."""

    def __init__(self, collector: Any, base: Any, args: tuple, kwargs: dict) -> None:
        self.base = base
        self.sync = base is torchrl_distributed.DistributedSyncCollector
        self.pushes: _NumberedPushes | None = None
        self.leaves: dict[int, TrainerLeaves] = {}  # by id of the trainer's push scheme
        self.failed = False
        collector._shmsync = self  # before TorchRL's constructor, which may shut the collector down
        remote_schemes = claim_remote_schemes(kwargs.get("collector_kwargs"), "distributed", base.__name__)
        if remote_schemes:
            compat.before_nodes_start(collector, lambda: self._before_nodes_start(remote_schemes, collector))
        base.__init__(collector, *args, **kwargs)
        if not remote_schemes:
            return
        try:
            keys = list(dict.fromkeys(s.settings.version_key for s in remote_schemes if s.settings.version_key))
            _add_version_keys(collector, keys)
            self.pushes = _NumberedPushes(collector, wait_until_ready=self.sync, leaves=self.leaves)
            for scheme in remote_schemes:  # scheme.readers() lists every node's workers
                scheme.remote_rows.add(self.pushes)
        except BaseException:
            self.failed = True
            collector.shutdown()
            raise

    def _before_nodes_start(self, remote_schemes: list[Any], collector: Any) -> None:
        """Right before the nodes start: the local schemes learn where the push store listens, and
        each push scheme sends each node only the leaves that changed since its version."""
        _tell(remote_schemes, collector)
        for scheme in compat.schemes_of(collector).values():
            leaves = TrainerLeaves(compat.push_store(scheme))
            leaves.install(scheme)
            compat.set_node_transports(scheme, NodeTransports())
            self.leaves[id(scheme)] = leaves

    def iterator(self, collector: Any) -> Iterator[Any]:
        pushes = self.pushes
        if pushes is not None:
            pushes.wait_until_ready()  # before TorchRL's first push
        for batch in self.base.iterator(collector):
            if pushes is not None:
                pushes.check_reports()
            yield batch

    def shutdown(self, collector: Any, *args: Any, **kwargs: Any) -> None:
        failed = self.failed or (self.pushes is not None and self.pushes.failed)
        # DistributedSyncCollector's nodes collect on their own until their last frame: after shmsync
        # raised they would not end, and TorchRL would wait for each, then leave it running (the
        # trainer then waits for it at exit). DistributedCollector's nodes answer TorchRL's shutdown.
        if failed and self.sync:
            _stop(compat.node_processes(collector))
        try:
            self.base.shutdown(collector, *args, **kwargs)
        finally:
            _stop(compat.node_processes(collector))  # any TorchRL left running


def _tell(remote_schemes: list[Any], collector: Any) -> None:
    """Right before the nodes start: each local scheme learns where the trainer's push store listens."""
    addresses = [compat.push_address(scheme) for scheme in compat.schemes_of(collector).values()]
    for scheme in remote_schemes:
        scheme.sender_side.upstream = addresses[0] if addresses else None


def _stop(nodes: list[Any] | None) -> None:
    """End node processes that are still running (their workers end with them: their pipes close)."""
    for job in nodes or ():
        if job.is_alive():
            job.terminate()
            job.join(5)
        if job.is_alive():
            job.kill()
            job.join(5)


def _with_shmsync_nodes(base: Any, doc: str) -> type:
    """``base``, one of TorchRL's two torch.distributed collectors, with shmsync's part (:class:`_Nodes`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _Nodes(self, base, args, kwargs)

    def iterator(self) -> Iterator[Any]:
        return self._shmsync.iterator(self)

    def shutdown(self, *args: Any, **kwargs: Any) -> None:
        nodes = getattr(self, "_shmsync", None)
        if nodes is None:  # not built yet
            return base.shutdown(self, *args, **kwargs)
        return nodes.shutdown(self, *args, **kwargs)

    members = {"__init__": __init__, "iterator": iterator, "shutdown": shutdown, "__doc__": doc}
    return type(base.__name__, (base,), {**members, "__module__": __name__, "__qualname__": base.__name__})


DistributedSyncCollector = _with_shmsync_nodes(
    torchrl_distributed.DistributedSyncCollector,
    """TorchRL's ``DistributedSyncCollector``, with shmsync as each node's local scheme (see the module).

    Its nodes receive pushes before their own collector (and so their store) exists: the first
    batch waits until every node's store exists (at most 60 s; a node that exited first is named).""",
)
DistributedCollector = _with_shmsync_nodes(
    torchrl_distributed.DistributedCollector,
    """TorchRL's ``DistributedCollector``, with shmsync as each node's local scheme (see the module).""",
)


class RayCollector(torchrl_distributed.RayCollector):
    """TorchRL's ``RayCollector``, with shmsync as each actor's local scheme (see the module).

    Each push is named to the actors it reaches in a call of shmsync's own, submitted just before
    TorchRL's (Ray runs one caller's calls to an actor in order), and each of them is asked
    afterwards which version it published: one short Ray call per actor and push.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._shmsync_schemes = claim_remote_schemes(kwargs.get("collector_kwargs"), "ray", "RayCollector")
        self._shmsync_pushes = 0  # pushes numbered: the last may still be on its way
        self._shmsync_confirmed = 0  # the newest push every actor it was sent to confirmed
        self._shmsync_book = ReportBook(version=lambda: self._shmsync_confirmed)
        for scheme in self._shmsync_schemes:  # scheme.readers() lists every actor's workers
            scheme.remote_rows.add(self._shmsync_book)
        super().__init__(*args, **kwargs)

    def update_policy_weights_(self, policy_or_weights: Any = None, *, worker_ids: Any = None, **kwargs: Any) -> Any:
        if not self._shmsync_schemes:
            return super().update_policy_weights_(policy_or_weights, worker_ids=worker_ids, **kwargs)
        import ray

        actors = self._shmsync_actors(worker_ids)
        self._shmsync_pushes += 1
        number = self._shmsync_pushes
        for _, actor in actors:
            actor.__ray_call__.remote(name_push, number)
        result = super().update_policy_weights_(policy_or_weights, worker_ids=worker_ids, **kwargs)
        answers = ray.get(
            [actor.__ray_call__.remote(published_version) for _, actor in actors], timeout=CONFIRM_TIMEOUT_S
        )
        compat.check_ray_push_confirmed(
            [
                f"actor {i} holds version {v}, not push {number}"
                for (i, _), (v, _) in zip(actors, answers)
                if v != number
            ]
        )
        self._shmsync_confirmed = number
        for (i, _), (_, report) in zip(actors, answers):
            self._shmsync_heard(i, report)
        return result

    def stop_remote_collectors(self) -> None:
        """Ask each actor to shut its collector down and exit, and wait for them (at most
        ``EXIT_TIMEOUT_S``), before TorchRL kills them (``ray.kill``): an actor that exits runs its
        process's cleanup, where a killed actor leaves its collector's multiprocessing semaphores
        in ``/dev/shm``. An actor still busy then is killed, as TorchRL does."""
        try:
            end_actors(list(self.remote_collectors), EXIT_TIMEOUT_S)
        except Exception as e:  # say, Ray shut down first: TorchRL's kill decides what happens
            log.debug("shmsync: the actors could not be ended gracefully: %s", e)
        super().stop_remote_collectors()

    def _shmsync_heard(self, actor: int, report: bytes | None) -> None:
        """An actor's readers' table, as it answered after a push (Ray runs an actor's calls one at a
        time: asking a busy actor would wait for its batch, so the trainer's table is as of the push)."""
        if report is None:
            return
        try:
            _, entries = decode_report(report)
        except ValueError as e:
            log.warning("shmsync: ignored actor %s's readers' report: %s", actor, e)
            return
        if entries:
            self._shmsync_book.heard(entries[0].node, f"actor {actor}", entries)

    def _shmsync_actors(self, worker_ids: Any) -> list[tuple[int, Any]]:
        actors = list(self.remote_collectors)
        if worker_ids is None:
            return list(enumerate(actors))
        ids = worker_ids if isinstance(worker_ids, (list, tuple)) else [worker_ids]
        return [(int(i), actors[int(i)]) for i in ids]


def end_actors(actors: list[Any], timeout: float) -> None:
    """Shut down each actor's collector, then end the actor as Ray ends one gracefully
    (``__ray_terminate__``: its exit handlers run); returns once every actor is exiting, or
    ``timeout`` passed. Ray runs an actor's calls in order: a busy actor answers after its batch."""
    if not actors:
        return
    import ray

    deadline = time.monotonic() + timeout
    closing = [actor.__ray_call__.remote(shut_down) for actor in actors]
    ray.wait(closing, num_returns=len(closing), timeout=timeout)
    # Each answers once its actor is exiting; the exit handlers then run to their end (a kill
    # after that point leaves the exit as it is).
    exits = [actor.__ray_terminate__.remote() for actor in actors]
    ray.wait(exits, num_returns=len(exits), timeout=max(0.0, deadline - time.monotonic()))


__all__ = ["DistributedCollector", "DistributedSyncCollector", "RayCollector"]
