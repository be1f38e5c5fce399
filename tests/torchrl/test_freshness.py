"""Fresh as well as exact: with no weights argument, ``update_policy_weights_()`` gives the
workers' next work the trainer's weights as they are when that work starts, as TorchRL's default
scheme does, in both call orders TorchRL's own scripts use; and every frame still runs exactly
the version on its tag.

The policy acts its bias (its weight is zero), so a batch's actions name the weights it ran. The
trainer's "optimizer step" adds 0.25 to the bias in place.
"""

import warnings

import pytest
import torch
from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector

from shmsync import ShmWeightSyncScheme, staleness
from shmsync.errors import FreshnessWarning, InvalidArgumentError
from tests.torchrl.collectors import make_linear_policy, make_pendulum
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.torchrl, pytest.mark.timeout(240)]

BATCHES = 6
STEP = 0.25  # exact in float32: the actions compare exactly


def _step(policy) -> None:
    """The trainer's optimizer step: in place, as torch's optimizers write."""
    with torch.no_grad():
        policy.module.bias.add_(STEP)


def _loop(order: str, shmsync: bool, cls=MultiSyncCollector, device: str = "cpu"):
    """Run ``BATCHES`` batches in ``order``; per batch, the actions it ran, its tags, and (shmsync)
    the newest version's bias when the batch arrived."""
    policy = make_linear_policy(0.0).to(device)
    scheme = ShmWeightSyncScheme() if shmsync else None
    collector = cls(
        [make_pendulum] * 2,
        policy,
        frames_per_batch=20,
        total_frames=-1,
        device=device if device != "cpu" else None,
        weight_sync_schemes={"policy": scheme} if shmsync else None,
    )
    out = []
    try:
        for _, batch in zip(range(BATCHES), collector):
            actions = sorted(set(batch["action"].flatten().tolist()))
            tags = sorted(set(batch["policy_version"].flatten().tolist())) if shmsync else []
            newest = None
            if shmsync:
                snap = scheme.store.snapshot()
                newest = (snap.version, float(snap.weights["policy", "module", "bias"][0]))
            out.append((actions, tags, newest))
            if order == "update, then train":  # sac.py, td3.py, ddpg.py...
                collector.update_policy_weights_()
                _step(policy)
            else:  # ppo.py, dqn.py...
                _step(policy)
                collector.update_policy_weights_()
    finally:
        collector.shutdown()
    return out


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("order", ["update, then train", "train, then update"])
def test_each_batch_runs_the_weights_torchrls_default_runs_and_exactly_its_tag(order, device):
    """On a GPU the hand-out compares the weights on the device and enqueues its copy on the
    trainer's stream (the workers wait for that promised version at their rollout's start)."""
    default = _loop(order, shmsync=False, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FreshnessWarning)  # MultiSync: nothing older than the default
        shm = _loop(order, shmsync=True, device=device)
    assert [a for a, _, _ in default] == [[k * STEP] for k in range(BATCHES)]  # the default, as measured
    tags = []
    for k, ((ran, tag, (version, bias)), (default_ran, _, _)) in enumerate(zip(shm, default)):
        assert len(ran) == 1 and len(tag) == 1, f"batch {k} ran {ran} under tags {tag}: one state, one tag"
        assert ran == default_ran, f"batch {k} ran {ran}, TorchRL's default {default_ran}"
        assert tag == [version] and ran == [bias], f"batch {k}: tag {tag} ran {ran}, version {version} holds {bias}"
        tags.append(tag[0])
    assert tags == sorted(set(tags)), f"versions did not go up batch by batch: {tags}"


def test_multiasync_workers_get_what_training_changed_when_the_next_batch_is_asked_for():
    """Update, then train, then only iterate: the workers, collecting all along, run the trained
    weights from the next hand-out on (they stayed on the update's snapshot before), every frame
    one version with its tag's weights; said once, with the fix, that TorchRL's default shows
    them training as it happens."""
    policy = make_linear_policy(0.0)
    scheme = ShmWeightSyncScheme()
    collector = MultiAsyncCollector(
        [make_pendulum] * 2, policy, frames_per_batch=20, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    try:
        batches = iter(collector)
        next(batches)
        collector.update_policy_weights_()
        _step(policy)
        with pytest.warns(FreshnessWarning, match="after the optimizer steps"):
            batch = next(batches)  # the hand-out: the trained weights published as a new version
        trained = scheme.version
        assert trained == 2 and float(scheme.store.snapshot().weights["policy", "module", "bias"][0]) == STEP
        loaded = lambda: all(r.version == trained for r in scheme.readers(processes=False))  # noqa: E731
        wait_for(loaded, what="the workers to load it")
        seen = set()
        with warnings.catch_warnings():
            warnings.simplefilter("error", FreshnessWarning)  # once per collector
            for _ in range(6):
                batch = next(batches)
                for action, tag in zip(batch["action"].flatten().tolist(), batch["policy_version"].flatten().tolist()):
                    assert action == {0: 0.0, 1: 0.0, 2: STEP}[tag], f"a frame tagged {tag} ran {action}"
                    seen.add(tag)
        assert trained in seen, f"no frame ran the trained weights: tags {sorted(seen)}"
    finally:
        collector.shutdown()


def test_a_numbered_update_is_published_at_the_hand_out_under_its_number():
    """update_policy_weights_(version=n) with no weights on a MultiSyncCollector: the batch runs the
    trained weights as the hand-out found them, under the caller's number; a number that does not
    go up is refused at the call, not at the hand-out."""
    policy = make_linear_policy(0.0)
    scheme = ShmWeightSyncScheme()
    collector = MultiSyncCollector(
        [make_pendulum] * 2, policy, frames_per_batch=20, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    try:
        batches = iter(collector)
        next(batches)
        collector.update_policy_weights_(version=10)
        assert scheme.version == 0  # published as the next batch is handed out
        with pytest.raises(InvalidArgumentError, match="not higher"):
            collector.update_policy_weights_(version=9)
        _step(policy)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FreshnessWarning)
            batch = next(batches)
        assert set(batch["action"].flatten().tolist()) == {STEP}
        assert set(batch["policy_version"].flatten().tolist()) == {10}
        assert scheme.version == 10
    finally:
        collector.shutdown()


def test_a_numbered_update_on_multiasync_keeps_its_snapshot_and_says_the_default_would_be_fresher():
    """Workers that collect all along run a numbered update's snapshot at once; a number cannot be
    published again at the hand-out, so shmsync says once how to get fresher weights."""
    policy = make_linear_policy(0.0)
    scheme = ShmWeightSyncScheme()
    collector = MultiAsyncCollector(
        [make_pendulum] * 2, policy, frames_per_batch=20, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    try:
        batches = iter(collector)
        next(batches)
        collector.update_policy_weights_(version=10)
        assert scheme.version == 10
        _step(policy)
        with pytest.warns(FreshnessWarning, match="leave version= out"):
            next(batches)
        assert scheme.version == 10
    finally:
        collector.shutdown()


def test_an_update_with_weights_publishes_exactly_them_and_the_hand_out_keeps_them():
    """Weights passed are what the workers run, whatever the collector's policy holds by the hand-out."""
    policy = make_linear_policy(0.0)
    scheme = ShmWeightSyncScheme()
    collector = MultiSyncCollector(
        [make_pendulum] * 2, policy, frames_per_batch=20, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    try:
        batches = iter(collector)
        next(batches)
        collector.update_policy_weights_()  # no weights: for the hand-out...
        passed = make_linear_policy(1.5)
        collector.update_policy_weights_(passed)  # ...then weights passed: those, not the live policy's
        _step(policy)
        batch = next(batches)
        assert set(batch["action"].flatten().tolist()) == {1.5}
        # The first published before the second (versions in the order of the calls), the second last.
        assert set(batch["policy_version"].flatten().tolist()) == {2} and scheme.version == 2
    finally:
        collector.shutdown()


@pytest.mark.parametrize("passed", [False, True], ids=["no weights argument", "weights passed"])
def test_staleness_in_optimizer_steps_says_what_training_each_batch_missed(passed):
    """Update, then two optimizer steps, per batch: with no weights argument every batch ran the
    weights of every step so far (0 steps behind, in the frames and in the readers' table); the
    weights passed at the call missed the two steps taken after it, and staleness says so."""
    policy = make_linear_policy(0.0)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.125)
    scheme = ShmWeightSyncScheme()
    collector = MultiSyncCollector(
        [make_pendulum] * 2, policy, frames_per_batch=20, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    try:
        behind = []
        for i, batch in zip(range(4), collector):
            if i:
                behind.append(sorted(set(staleness(batch, scheme, unit="optim_steps").flatten().tolist())))
                assert {r.steps_behind for r in scheme.readers(processes=False)} == {behind[-1][0]}
            collector.update_policy_weights_(policy if passed else None)
            for _ in range(2):  # the optimizer steps on the batch, after the update (as td3.py does)
                optimizer.zero_grad()
                policy.module.bias.grad = torch.ones(1)
                optimizer.step()
        assert scheme.steps == 8
        assert behind == ([[2]] * 3 if passed else [[0]] * 3), behind
    finally:
        collector.shutdown()


@pytest.mark.parametrize("order", ["update, then train", "train, then update"])
def test_every_weight_trained_costs_one_version_and_one_copy_a_batch(order):
    """Every weight stepped at every batch, no weights argument: one version a batch, holding what
    training changed, copied once (the update is published as the batch is handed out)."""
    policy = make_linear_policy(0.0)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.125)
    scheme = ShmWeightSyncScheme()
    collector = MultiSyncCollector(
        [make_pendulum] * 2, policy, frames_per_batch=20, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    published = []
    copy = scheme.store.writer.copy
    original = copy.copy_source

    def counted(*args, **kwargs):
        version = original(*args, **kwargs)
        published.append((version, scheme.store.info()["copied_bytes"]))
        return version

    copy.copy_source = counted
    try:
        for i, batch in zip(range(5), collector):
            if i:
                assert set(batch["policy_version"].flatten().tolist()) == {i}
            if order == "update, then train":
                collector.update_policy_weights_()
            optimizer.zero_grad()
            for p in policy.parameters():
                p.grad = torch.ones_like(p)
            optimizer.step()
            if order == "train, then update":
                collector.update_policy_weights_()
        assert [v for v, _ in published] == [1, 2, 3, 4, 5]  # the last when the loop ended
        assert {copied for _, copied in published} == {sum(p.numel() * p.element_size() for p in policy.parameters())}
    finally:
        collector.shutdown()


@pytest.mark.parametrize("then", ["the loop ends", "shutdown"])
def test_an_update_waiting_for_its_hand_out_is_published_when_the_loop_ends_and_dropped_at_shutdown(then):
    """No hand-out will come: the loop ended (``break``), so the update is published then; or the
    collector shut down, so its workers run nothing more, and the update goes with them."""
    policy = make_linear_policy(0.0)
    scheme = ShmWeightSyncScheme()
    collector = MultiSyncCollector(
        [make_pendulum] * 2, policy, frames_per_batch=20, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    try:
        for _ in collector:
            collector.update_policy_weights_()
            _step(policy)
            assert scheme.version == 0
            if then == "shutdown":
                collector.shutdown()
            break
        if then == "the loop ends":
            assert scheme.version == 1
            assert float(scheme.store.snapshot().weights["policy", "module", "bias"][0]) == STEP
        else:
            assert scheme.version == 0 and scheme.promised == 0  # nothing left promised
    finally:
        collector.shutdown()
