"""The version each frame carries: tag_versions records the version of the weights that produced
each frame (a key written by someone else is left alone), TorchRL's staleness-aware replay gates
exactly the frames that are too old, and lag_stats summarizes a batch's lag for a logger."""

import pytest
import torch

from tests.torchrl.collectors import pendulum_collector


def test_a_version_key_written_by_someone_else_is_left_whole_with_one_warning():
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule

    from shmsync import tag_versions

    class FloatVersion(torch.nn.Module):
        def forward(self, obs):
            return obs.sum(-1, keepdim=True), torch.full(obs.shape[:-1], 0.5)

    policy = TensorDictModule(FloatVersion(), in_keys=["obs"], out_keys=["action", "policy_version"])
    tag_versions(policy, lambda: 7)
    with pytest.warns(UserWarning, match="frames already carry 'policy_version'.*version_key='shmsync_version'"):
        out = policy(TensorDict({"obs": torch.ones(3, 2)}, [3]))
    assert out["policy_version"].dtype == torch.float32 and (out["policy_version"] == 0.5).all()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        policy(TensorDict({"obs": torch.ones(3, 2)}, [3]))
    # A key of its own: both tags, side by side.
    tag_versions(policy, lambda: 7, key="shmsync_version")
    out = policy(TensorDict({"obs": torch.ones(3, 2)}, [3]))
    assert out["shmsync_version"].tolist() == [7, 7, 7] and (out["policy_version"] == 0.5).all()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_staleness_aware_sampler_gates_exactly_the_frames_older_than_the_bound():
    from torchrl.collectors import MultiAsyncCollector
    from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

    samplers = pytest.importorskip("torchrl.data.replay_buffers.samplers")
    if not hasattr(samplers, "StalenessAwareSampler"):
        pytest.skip("TorchRL's StalenessAwareSampler came in 0.12")
    StalenessAwareSampler = samplers.StalenessAwareSampler

    max_staleness = 2
    sampler = StalenessAwareSampler(max_staleness=max_staleness, staleness_weight_fn=lambda s: torch.ones_like(s))
    buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(2000), sampler=sampler, batch_size=20_000)
    collector = pendulum_collector(MultiAsyncCollector, frames_per_batch=50)
    try:
        for i, batch in enumerate(collector):
            buffer.extend(batch.reshape(-1))
            collector.update_policy_weights_()
            if i == 10:
                break
        version = collector.get_policy_version() if hasattr(collector, "get_policy_version") else None
        stored = buffer.storage[: len(buffer)]["policy_version"].flatten()
        latest = int(stored.max())
        assert version is None or version >= latest
        assert len(stored.unique()) > max_staleness + 1, "too few versions in the buffer to gate any"
        sampler.consumer_version = latest
        sampled = buffer.sample()
        versions = sampled["policy_version"].flatten()
        assert int(versions.min()) >= latest - max_staleness, "a frame older than the bound was sampled"
        fresh = (stored >= latest - max_staleness).nonzero().flatten()
        # Uniform weights, 20,000 draws over at most 550 frames: every fresh frame is drawn.
        assert set(sampled["index"].flatten().tolist()) == set(fresh.tolist()), "fresh frames were left out"
    finally:
        collector.shutdown()


def test_lag_stats_leave_out_masked_frames_and_read_the_readers_table(store_factory):
    from tensordict import TensorDict

    from shmsync import WeightReader, lag_stats

    store = store_factory(torch.nn.Linear(2, 2))
    reader = WeightReader(store, torch.nn.Linear(2, 2))
    reader.poll()
    for _ in range(3):
        store.publish(torch.nn.Linear(2, 2))
    batch = TensorDict(
        {"policy_version": torch.tensor([0, 1, 3, 2]), ("collector", "mask"): torch.tensor([True, True, True, False])},
        batch_size=[4],
    )
    stats = lag_stats(batch, store)
    assert stats == {
        "policy_lag/frames_mean": pytest.approx(5 / 3),
        "policy_lag/frames_min": 0.0,
        "policy_lag/frames_max": 3.0,
        "policy_lag/frames_steps_mean": 0.0,  # no optimizer stepped on these weights
        "policy_lag/frames_steps_max": 0.0,
        "policy_lag/readers": 1.0,
        "policy_lag/readers_mean": 3.0,
        "policy_lag/readers_min": 3.0,
        "policy_lag/readers_max": 3.0,
    }
    with pytest.raises(KeyError, match="policy_version"):
        lag_stats(TensorDict({}, batch_size=[2]), store)
