"""Versions on frames: TorchRL's staleness-aware replay gates exactly the frames that are too old."""

import pytest
import torch
from torchrl.collectors import MultiAsyncCollector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from helpers import pendulum_collector

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_staleness_aware_sampler_gates_exactly_the_frames_older_than_the_bound():
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
