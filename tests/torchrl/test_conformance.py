"""Every path of TorchRL's weight-sync API with ShmWeightSyncScheme, on real collectors and gymnasium envs.

Modelled on TorchRL's own collector tests (``test/test_collectors.py``: ``TestMakePolicyFactory``,
``TestPolicyFactory``, ``TestPolicyVersion``, ``TestUpdateParams``, ``TestCollectHooks``,
``TestAsyncCollection.test_start_update_policy``), with shmsync's scheme in place of TorchRL's.
The one behaviour kept different on purpose: workers hold private copies, so an in-place edit of
the trainer's policy reaches no worker until ``update_policy_weights_()`` publishes it
(see ``test_scheme.py``).
"""

import functools
import time

import psutil
import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, ReplayBuffer

from shmsync import ShmWeightSyncScheme
from shmsync.torchrl.compat import TORCHRL_VERSION
from tests.torchrl.collectors import (
    TIE,
    count_rollouts,
    linear_weights,
    make_env,
    make_linear_policy,
    make_pendulum,
    make_policy,
    make_scaled_policy,
    write_rollout_count,
)
from tests.waiting import STUCK_S
from tests.weights import fill

# Each test builds collectors and drives TorchRL's calls through the scheme: the main tier, replayed
# under TorchRL's nightly and (make test-full) every older minor.
pytestmark = [pytest.mark.slow, pytest.mark.torchrl, pytest.mark.timeout(180)]
# Marked `minors` too: a path whose outcome depends on TorchRL's release (the boundary's entries,
# TorchRL's own calls), replayed under every older minor by `make test`. The others drive shmsync's
# own fallbacks, which do not change with the minor.

COLLECTORS = [functools.partial(MultiSyncCollector, cat_results="stack"), MultiAsyncCollector]
IDS = ["sync", "async"]


def _collector(cls, envs, policy, scheme=None, frames_per_batch=40, **kwargs):
    """An unbounded collector of ``envs`` whose workers get ``policy`` through shmsync."""
    schemes = {"policy": scheme if scheme is not None else ShmWeightSyncScheme()}
    return cls(envs, policy, frames_per_batch=frames_per_batch, total_frames=-1, weight_sync_schemes=schemes, **kwargs)


def _next_batches(it, n):
    return [next(it) for _ in range(n)]


def _actions_become(it, value, batches=10):
    """Collect until a whole batch acts ``value`` (async batches may straddle the update)."""
    for _ in range(batches):
        batch = next(it)
        if torch.allclose(batch["action"], torch.full_like(batch["action"], value)):
            return batch
    raise AssertionError(f"actions never became {value}; last batch: {batch['action'].flatten()[:8]}")


# -- 1. init_on_sender before any collector exists ------------------------------------------------
# Each way of calling it once, on the two collectors in turn (the scheme does not see which).
@pytest.mark.parametrize(
    "how, cls",
    [
        # One form in `make test`; the others take the same path once the scheme holds its stores.
        pytest.param("model", COLLECTORS[0], id="model-sync", marks=pytest.mark.full),
        pytest.param("weights", COLLECTORS[1], id="weights-async"),
        pytest.param("params_map", COLLECTORS[0], id="params_map-sync", marks=pytest.mark.full),
        pytest.param("device_map_fn", COLLECTORS[1], id="device_map_fn-async", marks=pytest.mark.full),
    ],
)
def test_init_on_sender_before_the_collector(how, cls):
    scheme = ShmWeightSyncScheme()
    trainer_policy = make_linear_policy(0.5)
    weights = TensorDict.from_module(trainer_policy).data
    if how == "model":
        scheme.init_on_sender(model=make_linear_policy(0.5), devices=["cpu"] * 2, model_id="policy")
    elif how == "weights":
        scheme.init_on_sender(weights=weights.clone(), devices=["cpu"] * 2, model_id="policy")
    elif how == "params_map":
        scheme.init_on_sender(params_map={0: weights, 1: weights})
    else:
        scheme.init_on_sender(weights=weights, device_map_fn=lambda i, w: w, num_workers=2, model_id="policy")
    assert scheme.store.version == 0
    collector = cls(
        [make_pendulum] * 2,
        policy_factory=make_linear_policy,  # bias 0 until the store's weights load
        frames_per_batch=40,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
    )
    try:
        it = iter(collector)
        assert (next(it)["action"] == 0.5).all(), "workers did not load the scheme's initial weights"
        collector.update_policy_weights_(linear_weights(-1.0))
        batch = _actions_become(it, -1.0)
        assert (batch["policy_version"] == 1).all()
        collector.update_policy_weights_(weights=linear_weights(1.5))
        assert (_actions_become(it, 1.5)["policy_version"] == 2).all()
    finally:
        collector.shutdown()
    assert scheme.store.closed, "the collector's shutdown must free a pre-initialized scheme's store"


@pytest.mark.minors
def test_init_on_sender_without_anything_to_build_from_raises():
    with pytest.raises(ValueError, match="needs the collector"):
        ShmWeightSyncScheme().init_on_sender()
    with pytest.raises(ValueError, match="takes model_id only"):
        ShmWeightSyncScheme().init_on_sender(model_id="policy", context=object(), model=make_linear_policy())
    with pytest.raises(ValueError, match="worker indices"):
        ShmWeightSyncScheme().init_on_sender(params_map={1: linear_weights(0.0)})


# -- 2. collectors built from policy_factory alone --------------------------------------------------
def test_policy_factory_without_policy():
    cls = MultiAsyncCollector  # the sync collector takes the same factory path (init_on_sender above)
    collector = cls(
        [make_pendulum] * 2,
        policy_factory=functools.partial(make_linear_policy, 0.25),
        frames_per_batch=40,
        total_frames=-1,
        weight_sync_schemes={"policy": ShmWeightSyncScheme()},
    )
    try:
        it = iter(collector)
        batch = next(it)
        assert (batch["action"] == 0.25).all() and (batch["policy_version"] == 0).all()
        collector.update_policy_weights_(linear_weights(-0.75))
        assert (_actions_become(it, -0.75)["policy_version"] == 1).all()
    finally:
        collector.shutdown()


@pytest.mark.minors
def test_policy_factory_that_makes_no_module_raises():
    from torchrl.modules import RandomPolicy

    with pytest.raises(ValueError, match="has no weights"):
        MultiSyncCollector(
            [make_pendulum] * 2,
            policy_factory=functools.partial(RandomPolicy, make_pendulum().action_spec),
            frames_per_batch=40,
            total_frames=-1,
            weight_sync_schemes={"policy": ShmWeightSyncScheme()},
        )


# -- 3. per-worker weights --------------------------------------------------------------------------
def _distinct_factories(n=3):
    return [functools.partial(make_linear_policy, float(i)) for i in range(n)]


@pytest.mark.parametrize(  # turned on by hand, or by the distinct factories alone (the same stores)
    "flag", [pytest.param(True, id="per_worker_weights", marks=pytest.mark.full), pytest.param(False, id="auto")]
)
def test_per_worker_weights_with_distinct_factories(flag):
    scheme = ShmWeightSyncScheme(per_worker_weights=flag)
    collector = MultiSyncCollector(
        [make_pendulum] * 3,
        policy_factory=_distinct_factories(),
        frames_per_batch=30,
        total_frames=-1,
        cat_results="stack",
        weight_sync_schemes={"policy": scheme},
    )
    try:
        assert scheme.group.per_worker and len(scheme.stores) == 3
        it = iter(collector)
        actions = next(it)["action"]
        for w in range(3):
            assert (actions[w] == w).all(), f"worker {w} lost its factory's weights: {actions[w].flatten()[:4]}"
        collector.update_policy_weights_({0: linear_weights(10.0)})
        batch = next(it)
        assert (batch["action"][0] == 10).all() and (batch["action"][1] == 1).all() and (batch["action"][2] == 2).all()
        assert batch["policy_version"][0].unique().tolist() == [1]
        assert batch["policy_version"][1:].unique().tolist() == [0]
        assert scheme.versions == [1, 0, 0]
        collector.update_policy_weights_({w: linear_weights(100.0 * (w + 1)) for w in range(3)})
        batch = next(it)
        for w in range(3):
            assert (batch["action"][w] == 100.0 * (w + 1)).all()
        collector.update_policy_weights_(linear_weights(-1.0), worker_ids=[1, 2])
        batch = next(it)
        assert (batch["action"][0] == 100).all() and (batch["action"][1:] == -1).all()
        assert scheme.versions == [2, 2, 2]  # worker 0: updates 1 and 2; workers 1 and 2: updates 2 and 3
        assert (batch["next", "policy_version"] == batch["policy_version"]).all()
    finally:
        collector.shutdown()
    assert all(s.closed for s in scheme.stores)


def test_per_worker_weights_under_async_collection():
    collector = MultiAsyncCollector(
        [make_pendulum] * 2,
        policy_factory=_distinct_factories(2),
        frames_per_batch=20,
        total_frames=-1,
        weight_sync_schemes={"policy": ShmWeightSyncScheme(per_worker_weights=True)},
    )
    try:
        it = iter(collector)
        seen = set()
        for _ in range(6):
            seen.update(next(it)["action"].unique().tolist())
        assert seen == {0.0, 1.0}
        collector.update_policy_weights_({0: linear_weights(7.0)})
        seen = set()
        for _ in range(12):
            batch = next(it)
            seen.update(batch["action"].unique().tolist())
            # A frame of worker 0's version 1 acts 7; every other frame acts as before.
            v1 = batch["policy_version"] == 1
            assert (batch["action"][v1] == 7).all()
        assert 7.0 in seen and 1.0 in seen
    finally:
        collector.shutdown()


def test_updating_some_workers_of_shared_weights_raises_and_writes_nothing():
    # Checked in the scheme before anything is written, whichever collector calls it.
    policy = make_policy()
    scheme = ShmWeightSyncScheme()
    collector = _collector(MultiSyncCollector, [make_env] * 2, policy, scheme)
    try:
        with pytest.raises(ValueError, match="per_worker_weights=True"):
            collector.update_policy_weights_(worker_ids=[0])
        with pytest.raises(ValueError, match="per_worker_weights=True"):
            collector.update_policy_weights_({1: TensorDict.from_module(policy)})
        with pytest.raises(ValueError, match=r"name workers \[5\]"):
            collector.update_policy_weights_(worker_ids=[0, 5])
        assert scheme.version == 0
        collector.update_policy_weights_(worker_ids=[0, 1])  # every worker: fine
        collector.update_policy_weights_(worker_ids=torch.device("cpu"))
        assert scheme.version == 2
    finally:
        collector.shutdown()


# -- 4. hooks assigned after construction -----------------------------------------------------------
@pytest.mark.parametrize(  # the asynchronous collector's workers set their hooks alike
    "cls", [COLLECTORS[0], pytest.param(COLLECTORS[1], marks=pytest.mark.full)], ids=IDS
)
def test_hook_setters_keep_the_poll_and_the_tag(cls):
    policy = make_policy()
    collector = _collector(cls, [make_env] * 2, policy)
    try:
        # Assigned once the workers run, before collecting: TorchRL's setter replaces the workers'
        # hooks. (Assigned between batches, the async case once hung in the full suite with the
        # setter's round trip racing a running rollout; it never did alone.)
        collector.pre_collect_hook = count_rollouts
        collector.post_collect_hook = write_rollout_count
        it = iter(collector)
        next(it)
        fill(policy, 0)
        collector.update_policy_weights_()
        for _ in range(5):
            batch = next(it)
        assert (batch["action"] == TIE).all(), "the workers stopped loading new weights"
        assert (batch["policy_version"] == 1).all() and (batch["next", "policy_version"] == 1).all()
        assert (batch["next", "reward"] > 0).all(), "the user's hooks did not run"
        if cls is MultiAsyncCollector:
            return  # TorchRL's async collector stops yielding once its hooks are reset to None, whatever the scheme
        collector.pre_collect_hook = None
        collector.post_collect_hook = None
        collector.update_policy_weights_()
        batches = _next_batches(it, 4)
        assert (batches[-1]["policy_version"] == 2).all() and (batches[-1]["next", "policy_version"] == 2).all()
    finally:
        collector.shutdown()


# -- 5. TorchRL's policy-version tracking -----------------------------------------------------------
# The sync collector: the async one reports through the same tracker, and its updates while it
# collects are checked below.
@pytest.mark.minors
def test_track_policy_version_reports_the_loaded_version():
    def build():
        return _collector(MultiSyncCollector, [make_env] * 2, make_policy(), track_policy_version=True)

    collector = build()
    try:
        it = iter(collector)
        v0 = next(it)["next", "policy_version"]
        assert (v0 == 0).all()
        for _ in range(2):
            assert (next(it)["next", "policy_version"] == 0).all(), "the version moved without an update"
        collector.update_policy_weights_()
        collector.update_policy_weights_()
        assert collector.get_policy_version() == 2
        for _ in range(10):
            batch = next(it)
            if (batch["next", "policy_version"] == 2).all():
                break
        assert (batch["next", "policy_version"] == 2).all() and (batch["policy_version"] == 2).all()
        state = collector.state_dict()
        if TORCHRL_VERSION < (0, 14):
            return  # torchrl <= 0.13 keeps no version in a worker's state dict
        assert [state[f"worker{w}"]["policy_version"] for w in range(2)] == [2, 2]
    finally:
        collector.shutdown()

    restored = build()
    try:
        restored.load_state_dict(state)
        assert [restored.state_dict()[f"worker{w}"]["policy_version"] for w in range(2)] == [2, 2]
        batch = next(iter(restored))
        assert (batch["policy_version"] == 2).all() and (batch["next", "policy_version"] == 2).all()
        restored.update_policy_weights_()
        assert restored.get_policy_version() == 3
    finally:
        restored.shutdown()


def _table_versions(scheme):
    return {row.worker: row.version for row in scheme.readers()}


@pytest.mark.skipif(TORCHRL_VERSION < (0, 15), reason="worker_policy_versions() came in torchrl 0.15")
def test_worker_policy_versions_come_from_the_table_while_a_worker_is_frozen():
    # TorchRL asks each worker over its pipe (pausing asynchronous collection): a frozen worker
    # would never answer. shmsync answers from the readers' table.
    scheme = ShmWeightSyncScheme()
    collector = _collector(MultiAsyncCollector, [make_env] * 2, make_policy(), scheme, track_policy_version=True)
    frozen = None
    try:
        it = iter(collector)
        next(it)
        collector.update_policy_weights_()
        assert collector.get_policy_version() is None  # asynchronous: no one version for every worker
        deadline = time.monotonic() + 60
        while _table_versions(scheme) != {0: 1, 1: 1}:  # each worker loads version 1 as it collects
            assert time.monotonic() < deadline, f"the workers never loaded version 1: {_table_versions(scheme)}"
            next(it)
        frozen = psutil.Process(next(r.pid for r in scheme.readers() if r.worker == 1))
        frozen.suspend()
        collector.update_policy_weights_()
        started = time.monotonic()
        versions = collector.worker_policy_versions()
        assert time.monotonic() - started < STUCK_S, "the query waited for the frozen worker"
        assert versions[1] == 1 and versions[0] in (1, 2) and set(versions) == {0, 1}
        assert versions[0] <= _table_versions(scheme)[0]
    finally:
        if frozen is not None:
            frozen.resume()
        collector.shutdown()


# -- weights right after an update: parameters, buffers, every form TorchRL accepts ---------------------
FORMS = ["implicit", "module", "policy_kwarg", "tensordict", "state_dict", "weights_dict", "model_id"]


@pytest.mark.minors
def test_every_worker_holds_the_trainers_weights_after_an_update_in_every_form():
    """One collector, updated in each form TorchRL accepts, each with weights of its own."""
    policy = make_scaled_policy()
    collector = _collector(MultiSyncCollector, [make_pendulum] * 2, policy)
    try:
        it = iter(collector)
        next(it)
        for i, form in enumerate(FORMS, start=1):
            trainer = make_scaled_policy()
            bias = 0.125 * i
            with torch.no_grad():
                trainer.module.linear.bias.fill_(bias)
                trainer.module.scale.fill_(2.0 + i)  # a buffer
            if form == "implicit":
                TensorDict.from_module(trainer).to_module(policy)  # the collector's own policy, updated in place
                collector.update_policy_weights_()
            elif form == "module":
                collector.update_policy_weights_(trainer)
            elif form == "policy_kwarg":
                collector.update_policy_weights_(policy=trainer)
            elif form == "tensordict":
                collector.update_policy_weights_(TensorDict.from_module(trainer))
            elif form == "state_dict":
                collector.update_policy_weights_(trainer.state_dict())
            elif form == "weights_dict":
                collector.update_policy_weights_(weights_dict={"policy": trainer})
            else:
                collector.update_policy_weights_(trainer, model_id="policy")
            expected = trainer.state_dict()
            state = collector.state_dict()
            for w in range(2):
                got = state[f"worker{w}"]["policy_state_dict"]
                assert set(got) == set(expected), form
                for k in expected:
                    assert torch.equal(got[k], expected[k]), f"{form}: worker {w}: {k} differs"
            batch = next(it)
            action = bias * (2.0 + i)
            assert torch.allclose(batch["action"], torch.full_like(batch["action"], action)), form
            assert (batch["policy_version"] == i).all(), form
    finally:
        collector.shutdown()


# -- update_policy_weights_ while an asynchronous collection runs ---------------------------------------
def test_update_while_collecting_in_the_background():
    """The asynchronous collection TorchRL runs in a background thread (``start()``)."""
    cls = MultiAsyncCollector
    rb = ReplayBuffer(storage=LazyTensorStorage(2000))
    # The buffer's schema comes from the main process, where frames have no shmsync tag;
    # TorchRL's tracker column is in it, and reports the version each worker loaded.
    collector = _collector(
        cls,
        [make_pendulum] * 2,
        make_linear_policy(0.0),
        replay_buffer=rb,
        frames_per_batch=16,
        track_policy_version=True,
    )
    try:
        collector.start()
        deadline = time.monotonic() + 60
        while len(rb) < 32 and time.monotonic() < deadline:
            time.sleep(0.05)
        # The first batch, long written (the newest may still be being written, on torchrl 0.11).
        assert len(rb) >= 32 and (rb[:16]["action"] == 0).all()
        collector.update_policy_weights_(linear_weights(1.0))
        while time.monotonic() < deadline:
            time.sleep(0.05)
            last = rb[-16:]
            if (last["action"] == 1).all():
                break
        assert (last["action"] == 1).all(), "the update never reached the background collection"
        if TORCHRL_VERSION >= (0, 14):  # <= 0.13 leaves the tracker's column out of the buffer
            assert (last["next", "policy_version"] == 1).all()
    finally:
        collector.async_shutdown(timeout=10)


@pytest.mark.minors
def test_a_single_process_collector_says_the_scheme_has_nothing_to_do():
    from torchrl.collectors import Collector

    with pytest.raises(TypeError, match="Collector runs the trainer's policy in this process"):
        Collector(
            make_env,
            make_policy(),
            frames_per_batch=10,
            total_frames=20,
            weight_sync_schemes={"policy": ShmWeightSyncScheme()},
        )
