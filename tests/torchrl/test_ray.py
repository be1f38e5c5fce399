"""shmsync as each remote collector's local scheme under shmsync's RayCollector, on a local Ray
cluster bound to 127.0.0.1: every frame carries the trainer's version (whichever actors a push
reaches), and no store is left, however the actors end."""

from __future__ import annotations

import os

import psutil
import pytest
import torch

from shmsync import ShmWeightSyncScheme
from shmsync.torchrl.compat import TORCHRL_VERSION
from tests.commands import with_tests_importable
from tests.torchrl.collectors import make_marked_pendulum, make_pendulum, make_probe_policy
from tests.waiting import wait_for
from tests.weights import fill

ray = pytest.importorskip("ray")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torchrl,
    pytest.mark.distributed,
    pytest.mark.usefixtures("one_ray_cluster"),
    pytest.mark.timeout(300),
    pytest.mark.skipif(TORCHRL_VERSION < (0, 14), reason="RayCollector's schemes need torchrl >= 0.14"),
]


@pytest.fixture
def cluster(monkeypatch):
    """A Ray cluster of this test's own on 127.0.0.1 (the leak check after each test wants
    none of its processes left); its actors import the tests' helpers."""
    monkeypatch.setenv("PYTHONPATH", with_tests_importable()["PYTHONPATH"])
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def ray_collector(policy, sync: bool, total_frames: int = 600, workers: int = 2, scheme=None, **kwargs):
    """2 remote collectors (actor 2's observations shifted by +100) of ``workers`` Pendulum
    workers each."""
    from torchrl.collectors import MultiSyncCollector

    from shmsync.torchrl.distributed import RayCollector

    return RayCollector(
        [make_pendulum, make_marked_pendulum],
        policy,
        collector_class=MultiSyncCollector,
        collector_kwargs={"num_workers": workers, "weight_sync_schemes": {"policy": scheme or ShmWeightSyncScheme()}},
        remote_configs={"num_cpus": 1},
        frames_per_batch=100,
        total_frames=total_frames,
        sync=sync,
        **kwargs,
    )


def actor_pids(collector) -> set[int]:
    return set(ray.get([rc.__ray_call__.remote(lambda actor: os.getpid()) for rc in collector.remote_collectors]))


def semaphores_of(pids: set[int]) -> set[str]:
    """The named multiprocessing semaphores (``/dev/shm/sem.mp-*``) the processes ``pids`` and
    their descendants hold open: their collectors' queues and locks."""
    procs = []
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs += [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
    return _mapped_semaphores(procs)


def _mapped_semaphores(procs) -> set[str]:
    found = set()
    for proc in procs:
        try:
            found |= {m.path for m in proc.memory_maps(grouped=True) if m.path.startswith("/dev/shm/sem.mp-")}
        except psutil.Error:
            continue
    return found


def remove_orphaned(semaphores: set[str]) -> None:
    """Remove those of ``semaphores`` no live process holds open (their owners were killed)."""
    for path in semaphores - _mapped_semaphores(psutil.process_iter()):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def stores_of(pids: set[int]) -> list[str]:
    from shmsync.testing import stores_created_by

    return sorted(stores_created_by(pids))


def tags_match_weights(batch) -> list[int]:
    """Every frame's version tag is the version whose weights (all filled with that number) acted."""
    tags = batch["policy_version"]
    assert torch.equal(batch["w_lo"], batch["w_hi"]), "a frame was produced by a mix of two versions"
    assert torch.equal(batch["w_lo"].long(), tags), "a frame is tagged with a version whose weights did not act"
    return sorted(set(tags.flatten().tolist()))


@pytest.mark.minors  # its outcome depends on TorchRL's release: it runs under every older minor too
def test_every_frame_carries_the_trainers_version_and_no_store_is_left(cluster):
    policy = make_probe_policy()
    fill(policy, 0)
    scheme = ShmWeightSyncScheme()
    collector = ray_collector(policy, sync=True, scheme=scheme)
    pids = actor_pids(collector)
    workers = ray.get([rc.__ray_call__.remote(lambda actor: actor.num_workers) for rc in collector.remote_collectors])
    semaphores = semaphores_of(pids)
    seen = []
    try:
        for i, batch in enumerate(collector):
            seen.append(tags_match_weights(batch))
            fill(policy, i + 1)
            collector.update_policy_weights_(policy)  # push i + 1, to both actors
            # Each actor answers a push with its readers' table: every worker of every actor.
            table = scheme.readers()
            assert sorted(h.readers for h in table.hosts) == sorted(workers) and len(table) == sum(workers), table
            assert table.version == i + 1 and all(r.report_age_s is not None for r in table), table
            assert sorted(r.worker for r in table) == sorted(w for n in workers for w in range(n))
    finally:
        collector.shutdown()
    assert seen == [[i] for i in range(len(seen))] and len(seen) == 6, seen
    assert stores_of(pids) == [], "a remote collector's store outlived its actor"
    # The actors exit rather than being killed: their collectors' semaphores go with them.
    assert semaphores
    wait_for(lambda: not [s for s in semaphores if os.path.exists(s)], timeout=10, what="the actors' semaphores to go")


@pytest.mark.full  # a second Ray cluster's worth: the numbered pushes above stay in `make test`
def test_a_push_to_some_actors_only_still_carries_the_trainers_number(cluster):
    """RayCollector(sync=False) updates only the actor that delivered: the actors' pushes are
    numbered by the trainer, not by each actor (whose own counts would drift apart)."""
    policy = make_probe_policy()
    fill(policy, 0)
    # One worker per actor: what is under test is the numbering across actors.
    collector = ray_collector(policy, sync=False, total_frames=600, workers=1, update_after_each_batch=True)
    pids = actor_pids(collector)
    per_actor = {1: [], 2: []}
    try:
        for i, batch in enumerate(collector):
            actor = 2 if float(batch["observation"].mean()) > 50 else 1
            per_actor[actor] += tags_match_weights(batch)
            fill(policy, i + 1)  # TorchRL then pushes it, as push i + 1, to this actor alone
    finally:
        collector.shutdown()
    assert per_actor[1] and per_actor[2], per_actor
    for versions in per_actor.values():
        assert versions == sorted(versions), f"an actor went back: {per_actor}"
    assert stores_of(pids) == []


def test_killed_actors_and_a_ray_shutdown_leave_no_store(cluster):
    policy = make_probe_policy()
    collector = ray_collector(policy, sync=True, total_frames=100_000, workers=1)
    pids = actor_pids(collector)
    it = iter(collector)
    next(it)
    semaphores = semaphores_of(pids)
    try:
        # Killed as Ray kills them (with their workers), in the middle of a run: nothing to clean up.
        ray.kill(collector.remote_collectors[0])
        with pytest.raises(ray.exceptions.RayError):
            for _ in range(5):
                next(it)
        ray.shutdown()  # the other actor, with no shutdown() first
        assert stores_of(pids) == []
    finally:
        remove_orphaned(semaphores)  # multiprocessing's, left by the killed actor's collector


@pytest.mark.minors  # its outcome depends on TorchRL's release: it runs under every older minor too
def test_torchrls_own_ray_collector_with_a_shmsync_local_leg_is_refused_at_once(cluster):
    """TorchRL's RayCollector carries no trainer version to its actors: refused as it creates
    them, naming the class to use instead."""
    from torchrl.collectors import MultiSyncCollector
    from torchrl.collectors.distributed import RayCollector

    with pytest.raises(Exception, match=r"shmsync\.torchrl\.distributed\.RayCollector"):
        RayCollector(
            [make_pendulum],
            make_probe_policy(),
            collector_class=MultiSyncCollector,
            collector_kwargs={"num_workers": 1, "weight_sync_schemes": {"policy": ShmWeightSyncScheme()}},
            remote_configs={"num_cpus": 1},
            frames_per_batch=100,
            total_frames=200,
        )
