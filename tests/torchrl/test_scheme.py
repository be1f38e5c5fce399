"""ShmWeightSyncScheme with real TorchRL multi-process collectors on gymnasium environments."""

import json
import os
import threading

import pytest
import torch
import torchrl.trainers
from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector

from shmsync import (
    ClosedError,
    NotAttachedError,
    ShmWeightSyncScheme,
    StoreNotFoundError,
    UpdateWeights,
    WeightStore,
    staleness,
)
from tests.commands import cli, python, run_command, with_tests_importable
from tests.torchrl.collectors import (
    TIE,
    make_env,
    make_loss,
    make_marked_env,
    make_normed_env,
    make_pendulum,
    make_policy,
    make_probe_policy,
    make_trainer,
    pendulum_collector,
)
from tests.weights import fill

# Each test builds collectors and drives TorchRL's calls through the scheme: the main tier, replayed
# under TorchRL's nightly; those marked `minors` also under every older minor in `make test`.
pytestmark = [pytest.mark.slow, pytest.mark.torchrl, pytest.mark.timeout(180)]


def _is_tie(actions):
    return (actions == TIE).all(-1)


def _batch_after_publishing_zeros(collector, policy):
    """Collect one batch, zero the trainer's policy and publish it, then collect the next batch."""
    it = iter(collector)
    next(it)
    fill(policy, 0)
    collector.update_policy_weights_()
    return next(it)


def _collector(cls, workers, policy, frames=40, **scheme_kwargs):
    scheme = ShmWeightSyncScheme(**scheme_kwargs)
    collector = cls(
        [make_env, make_marked_env][:workers] if workers <= 2 else [make_env] * workers,
        policy,
        frames_per_batch=frames * workers,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
    )
    return collector, scheme


@pytest.mark.parametrize(
    "cls, workers, zero_copy",
    [
        # Private copies under MultiSync with 1 worker: MultiAsync's private copies take the same path.
        pytest.param(MultiSyncCollector, 1, False, marks=pytest.mark.full),
        (MultiAsyncCollector, 2, False),
        (MultiSyncCollector, 2, True),  # in place
    ],
)
def test_published_weights_reach_every_worker_and_edits_do_not(cls, workers, zero_copy):
    policy = make_policy()
    collector, scheme = _collector(cls, workers, policy, zero_copy=zero_copy)
    try:
        it = iter(collector)
        batch = next(it)
        assert (batch["policy_version"] == 0).all()
        fill(policy, 0)  # an in-place edit on the trainer, not published
        for _ in range(2 * workers):
            batch = next(it)
            assert (batch["policy_version"] == 0).all()
            assert not _is_tie(batch["action"]).any(), "an unpublished edit reached a worker"
        collector.update_policy_weights_()
        if cls is MultiSyncCollector:
            # Published as the next batch is handed out, or before the workers' weights are read:
            # every worker reports the new weights right away (state_dict polls the store).
            assert scheme.version == 0
            state = collector.state_dict()
            for w in range(workers):
                weights = state[f"worker{w}"]["policy_state_dict"]
                assert all((v == 0).all() for v in weights.values()), f"worker {w} kept old weights"
        assert scheme.version == 1
        new_frames_per_worker = [0] * workers
        for _ in range(6 * workers):
            batch = next(it)
            new = batch["policy_version"] == 1
            assert _is_tie(batch["action"][new]).all(), "frames tagged 1 were not produced by version 1"
            assert not _is_tie(batch["action"][~new]).any(), "frames tagged 0 were produced by version 1"
            worker = (batch["observation"][..., 0] > 50).long()  # worker 1's observations are shifted
            for w in range(workers):
                new_frames_per_worker[w] += int((new & (worker == w)).sum())
        assert all(n > 0 for n in new_frames_per_worker), f"a worker kept the old weights: {new_frames_per_worker}"
        if zero_copy and cls is MultiSyncCollector:
            # 4 slots: every worker's policy views the store's memory.
            assert [r.zero_copy for r in scheme.store.readers()] == [True] * workers
    finally:
        collector.shutdown()


def test_tags_follow_published_versions_in_sync_collector():
    policy = make_policy()
    collector, scheme = _collector(MultiSyncCollector, 2, policy)
    try:
        for i, batch in enumerate(collector):
            # The sync collector collects batch i after the i-th publish.
            assert batch["policy_version"].unique().tolist() == [i]
            assert batch["next", "policy_version"].unique().tolist() == [i]
            assert (staleness(batch, scheme.store) == 0).all()
            collector.update_policy_weights_()
            if i == 5:
                break
        assert scheme.version == 6
    finally:
        collector.shutdown()


def test_with_the_opt_in_background_copy_the_next_batch_still_runs_the_weights_sent():
    """``unsafe_background_copy=True``: ``update_policy_weights_()`` returns once the version is
    promised, and the workers wait for it at the start of their next rollout, so the batch after each
    update runs the weights just sent, whole, while the trainer keeps its side of the contract (no
    write until the copy landed: here, the next update)."""
    policy = make_probe_policy(big=2048)  # 16 MB: a copy that takes a while
    scheme = ShmWeightSyncScheme(unsafe_background_copy=True)
    collector = MultiSyncCollector(
        [make_pendulum] * 2, policy, frames_per_batch=40, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    try:
        assert scheme.store.unsafe_background_copy
        it = iter(collector)
        next(it)
        for version in range(1, 7):
            fill(policy, version)
            collector.update_policy_weights_()
            batch = next(it)
            assert torch.equal(batch["w_lo"], batch["w_hi"]), "a frame ran a mix of two versions"
            assert (batch["w_lo"] == version).all(), f"the batch after update {version} ran {batch['w_lo'].unique()}"
            assert (batch["policy_version"] == version).all()
    finally:
        collector.shutdown()


def test_poll_inside_long_rollouts():
    policy = make_policy()
    collector, scheme = _collector(MultiSyncCollector, 1, policy, frames=400, poll_every_steps=10)
    try:
        # Already published before the next rollout: all of it is version 1.
        batch = _batch_after_publishing_zeros(collector, policy)
        assert (batch["policy_version"] == 1).all()
    finally:
        collector.shutdown()


def test_the_store_leaves_the_host_once_every_worker_attached_and_shutdown_frees_it():
    policy = make_policy()
    collector, scheme = _collector(MultiSyncCollector, 2, policy)
    store = scheme.store
    name = store.name
    try:
        # Both workers attached while the collector was built: the name is gone already, so
        # nothing can leak the store, whatever kills these processes; the workers still load.
        assert len(store.readers()) == 2
        assert not os.path.exists(f"/dev/shm/shmsync-{name}")
        with pytest.raises(StoreNotFoundError):
            WeightStore.attach(name)
        it = iter(collector)
        next(it)
        collector.update_policy_weights_(policy)  # weights passed: published before the call returns
        # Between batches each worker waits, one version behind; the table says which is which.
        table = scheme.readers()
        assert sorted((r.worker, r.version, r.behind, r.waiting) for r in table) == [(0, 0, 1, True), (1, 0, 1, True)]
        # Another process finds the unlinked store through its workers, and lists them.
        line = next(line for line in cli("ls").stdout.splitlines() if line.startswith(name))
        assert line.endswith("in use, unlinked") and " 2  " in line
        doc = json.loads(cli("ls", name, "--json").stdout)
        assert sorted((r["worker"], r["pid"]) for r in doc["readers"]) == sorted((r.worker, r.pid) for r in table)
        assert (next(it)["policy_version"] == 1).all()
    finally:
        collector.shutdown()
    assert store.closed
    # Its stores are gone: an update or a look at the workers says so, rather than doing nothing.
    with pytest.raises(ClosedError, match=r"the collector is shut down: .* reaches no worker"):
        collector.update_policy_weights_()
    with pytest.raises(NotAttachedError, match=r"\(or its collector\) was shut down, so it has no workers"):
        scheme.readers()
    with pytest.raises(ClosedError, match="the collector is shut down"):
        scheme.send()
    assert scheme.version == 1  # the last version its stores held
    scheme.shutdown()  # the scheme's own shutdown lets its stores go: no version to tell
    with pytest.raises(NotAttachedError, match=r"\(or its collector\) was shut down, so it has no version"):
        scheme.version  # noqa: B018  (the property is what is tested)


def test_a_scheme_no_collector_set_up_says_so_rather_than_listing_no_worker():
    scheme = ShmWeightSyncScheme()
    for call in (scheme.readers, scheme.send, lambda: scheme.version):
        with pytest.raises(NotAttachedError, match=r"not set up yet.*hand it to a collector"):
            call()
    assert scheme.store is None and scheme.stores == ()


def test_two_keys_publish_atomically():
    from torchrl.envs import ObservationNorm

    policy = make_policy()
    norm = ObservationNorm(loc=torch.zeros(4), scale=torch.ones(4), in_keys=["observation"])
    schemes = {"policy": ShmWeightSyncScheme(), "env.transform": ShmWeightSyncScheme(source=norm)}
    collector = MultiAsyncCollector(
        [make_normed_env] * 2, policy, frames_per_batch=50, total_frames=-1, weight_sync_schemes=schemes
    )
    try:
        store = schemes["policy"].store
        assert store is schemes["env.transform"].store and store.destinations == ("policy", "env.transform")
        it = iter(collector)
        next(it)
        fill(policy, 0)
        with torch.no_grad():
            norm.loc.fill_(-1000.0)  # observations become >= 997 once it arrives
        collector.update_policy_weights_(weights_dict={"policy": policy, "env.transform": norm})
        assert store.version == 1  # one version for both keys
        for _ in range(6):
            batch = next(it)
            v = batch["policy_version"]
            big_obs = (batch["observation"] > 900).all(-1)
            tie = _is_tie(batch["action"])
            # Frames of version 1 have both changes, frames of version 0 neither.
            assert (tie[v == 1]).all() and not tie[v == 0].any()
            assert not big_obs[v == 0].any()
    finally:
        collector.shutdown()


def test_no_frame_mixes_two_versions_under_async_publishing():
    policy = make_probe_policy()
    scheme = ShmWeightSyncScheme(poll_every_steps=1)
    collector = MultiAsyncCollector(
        [make_pendulum] * 2, policy, frames_per_batch=50, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    stop = threading.Event()
    published = []

    def publish_flat_out():
        from tensordict import TensorDict

        weights = TensorDict.from_module(policy).clone()
        while not stop.is_set():
            v = scheme.version + 1
            weights.apply_(lambda t, v=v: t.fill_(v))
            collector.update_policy_weights_(weights)
            published.append(v)

    thread = threading.Thread(target=publish_flat_out, daemon=True)
    try:
        it = iter(collector)
        next(it)
        thread.start()
        frames = mixed = 0
        versions = set()
        for _ in range(30):
            batch = next(it)
            lo, hi, tag = batch["w_lo"], batch["w_hi"], batch["policy_version"]
            mixed += int((lo != hi).sum())
            assert (lo[lo == hi] == tag[lo == hi].float()).all(), "a frame's tag differs from its weights"
            frames += batch.numel()
            versions.update(tag.unique().tolist())
        assert mixed == 0
        assert len(versions) > 5, f"publishing did not reach the workers: {versions}"
        assert frames == 30 * 50
    finally:
        stop.set()
        thread.join(10)
        collector.shutdown()


@pytest.mark.parametrize("hook_cls", [torchrl.trainers.UpdateWeights, UpdateWeights])
def test_update_weights_hooks_with_weight_update_map(hook_cls):
    policy = make_policy()
    collector, scheme = _collector(MultiSyncCollector, 2, policy, frames=25)
    trainer = make_trainer(collector, make_loss(policy), total_frames=250, optim_steps_per_batch=2)
    hook = hook_cls(collector, 1, weight_update_map={"policy": "loss_module.value_network"}, trainer=trainer)
    hook.register(trainer)
    tags = []
    trainer.register_op("batch_process", lambda batch: tags.append(batch["policy_version"].unique().tolist()))
    trainer.train()  # shuts the collector down at the end
    assert scheme.version == 5
    assert tags == [[i] for i in range(5)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_worker_policies():
    policy = make_policy()
    scheme = ShmWeightSyncScheme()
    collector = MultiSyncCollector(
        [make_env] * 2,
        policy,
        frames_per_batch=40,
        total_frames=-1,
        device="cuda:0",
        weight_sync_schemes={"policy": scheme},
    )
    try:
        batch = _batch_after_publishing_zeros(collector, policy)
        assert (batch["policy_version"] == 1).all() and _is_tie(batch["action"].cpu()).all()
    finally:
        collector.shutdown()


def test_fork_start_method():
    proc = run_command(
        python("-c", "from tests.torchrl.collectors import fork_collector_check; fork_collector_check()"),
        env=with_tests_importable(),
        timeout=150,
    )
    assert proc.returncode == 0 and "fork ok" in proc.stdout, proc.stderr[-3000:]


def test_update_policy_weights_with_a_version_tags_frames_with_it():
    collector = pendulum_collector(MultiSyncCollector, cat_results="stack")
    try:
        it = iter(collector)
        next(it)
        collector.update_policy_weights_(version=100)
        assert set(next(it)["policy_version"].unique().tolist()) <= {0, 100}
        assert next(it)["policy_version"].unique().tolist() == [100]
        with pytest.raises(ValueError, match="version 100 is not higher than the last published version 100"):
            collector.update_policy_weights_(version=100)
        collector.update_policy_weights_(version=250)
        next(it)
        assert next(it)["policy_version"].unique().tolist() == [250]
    finally:
        collector.shutdown()


@pytest.mark.minors  # its outcome depends on TorchRL's release: it runs under every older minor too
@pytest.mark.parametrize("name", ["MultiSyncDataCollector", "MultiaSyncDataCollector"])
def test_the_older_collector_names_tag_frames_with_published_versions(name):
    import torchrl.collectors

    cls = getattr(torchrl.collectors, name, None)
    if cls is None:
        pytest.skip(f"torchrl {torchrl.__version__} has no {name} (renamed in 0.13)")
    collector = pendulum_collector(cls)
    try:
        it = iter(collector)
        next(it)
        collector.update_policy_weights_()
        for _ in range(10):
            batch = next(it)
            if (batch["policy_version"] == 1).all():
                break
        assert (batch["policy_version"] == 1).all() and (batch["next", "policy_version"] == 1).all()
    finally:
        collector.shutdown()
