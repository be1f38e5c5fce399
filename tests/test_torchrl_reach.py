"""Reaching TorchRL users where they are: the backend registry, versions counted in optimizer
steps, and TorchRL's staleness-aware replay fed by shmsync's per-frame versions."""

import subprocess
import sys

import pytest
import torch
from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

from shmsync import ShmWeightSyncScheme, UpdateWeights, WeightSender
from shmsync._torchrl_compat import TORCHRL_VERSION

from rl import make_env, make_linear_policy, make_loss, make_pendulum, make_policy, make_trainer

pytestmark = [pytest.mark.torchrl, pytest.mark.timeout(180)]


@pytest.mark.skipif(TORCHRL_VERSION < (0, 14), reason="TorchRL's backend registry came in 0.14")
@pytest.mark.parametrize("first", ["shmsync", "torchrl"])
def test_from_backend_builds_the_scheme_whichever_is_imported_first(first):
    imports = ["import shmsync", "from torchrl.weight_update import WeightSyncScheme"]
    code = "; ".join(imports if first == "shmsync" else imports[::-1]) + (
        "; s = WeightSyncScheme.from_backend('shmsync', num_slots=5, zero_copy=True)"
        "; from shmsync import ShmWeightSyncScheme"
        "; assert type(s) is ShmWeightSyncScheme, type(s)"
        "; assert s.num_slots == 5 and s.zero_copy, vars(s)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_import_shmsync_leaves_torchrl_unloaded():
    code = "import sys, shmsync; assert not [m for m in sys.modules if m.startswith('torchrl')]"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _pendulum_collector(cls, frames_per_batch=40, **kwargs):
    """An unbounded 2-worker collector of Pendulum, its policy's weights all zero, synced by shmsync."""
    return cls(
        [make_pendulum] * 2,
        make_linear_policy(0.0),
        frames_per_batch=frames_per_batch,
        total_frames=-1,
        weight_sync_schemes={"policy": ShmWeightSyncScheme()},
        **kwargs,
    )


# -- versions given by the caller -----------------------------------------------------------------
def test_update_policy_weights_with_a_version_tags_frames_with_it():
    collector = _pendulum_collector(MultiSyncCollector, cat_results="stack")
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


@pytest.mark.parametrize("unit", ["batches", "optim_steps"])
def test_update_weights_can_version_by_optimizer_steps(store_factory, unit):
    from torchrl.collectors import Collector

    policy = make_policy()
    batches, fpb, optim_steps = 4, 20, 3
    collector = Collector(make_env, policy, frames_per_batch=fpb, total_frames=batches * fpb)
    trainer = make_trainer(collector, make_loss(policy), batches * fpb, optim_steps)
    store = store_factory({"policy": policy})
    hook = UpdateWeights(
        update_weights_interval=2,
        trainer=trainer,
        sender=WeightSender(store, {"policy": "loss_module.value_network"}, root=trainer),
        interval_unit=unit,
        version="optim_steps",
    )
    hook.register(trainer)
    seen = []
    trainer.register_op("post_steps", lambda: seen.append((trainer._optim_count, store.version)))
    trainer.train()
    # Every 2 batches (or 2 optimizer steps), the version is the optimizer-step count.
    if unit == "batches":
        assert [v for _, v in seen] == [0, 6, 6, 12]
    else:
        assert [v for _, v in seen] == [2, 6, 8, 12]
    assert all(v <= steps for steps, v in seen)


def test_versions_in_optimizer_steps_need_a_target_that_takes_them():
    from torchrl.collectors import Collector

    policy = make_policy()
    collector = Collector(make_env, policy, frames_per_batch=20, total_frames=40)
    trainer = make_trainer(collector, make_loss(policy), 40)
    with pytest.raises(ValueError, match="version='optim_steps' needs"):
        UpdateWeights(collector, 1, trainer=trainer, version="optim_steps")
    with pytest.raises(ValueError, match="version must be 'publishes' or 'optim_steps'"):
        UpdateWeights(collector, 1, trainer=trainer, version="frames")


# -- TorchRL's staleness-aware replay ----------------------------------------------------------------
def test_staleness_aware_sampler_gates_exactly_the_frames_older_than_the_bound():
    samplers = pytest.importorskip("torchrl.data.replay_buffers.samplers")
    if not hasattr(samplers, "StalenessAwareSampler"):
        pytest.skip("TorchRL's StalenessAwareSampler came in 0.12")
    StalenessAwareSampler = samplers.StalenessAwareSampler

    max_staleness = 2
    sampler = StalenessAwareSampler(max_staleness=max_staleness, staleness_weight_fn=lambda s: torch.ones_like(s))
    buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(2000), sampler=sampler, batch_size=20_000)
    collector = _pendulum_collector(MultiAsyncCollector, frames_per_batch=50)
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


# -- someone else's "policy_version" ---------------------------------------------------------------
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


# -- Hydra: TorchRL's config-driven trainers select shmsync by an override -----------------------
@pytest.mark.timeout(300)
@pytest.mark.skipif(TORCHRL_VERSION < (0, 14), reason="TorchRL's config-driven trainers came in 0.14")
def test_a_config_driven_trainer_selects_shmsync_by_an_override(tmp_path):
    import json
    import os
    from pathlib import Path

    pytest.importorskip("hydra")
    root = Path(__file__).resolve().parents[1]
    # An editable install serves the hydra_plugins namespace through an import hook that Hydra's
    # plugin scan cannot list; the source tree on the path is what a regular install looks like.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    override = "+weight_sync_scheme@collector.weight_sync_schemes.policy=shmsync"
    proc = subprocess.run(
        [sys.executable, str(root / "tests/hydra_app/train.py"), f"hydra.run.dir={tmp_path}", override],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["schemes"] == {"policy": "ShmWeightSyncScheme"}
    # 10 batches, one publish after each: frames carry the versions as they were published.
    assert result["versions"][0] == 0 and max(result["versions"]) >= 5, result


# -- TorchRL's older collector names ----------------------------------------------------------------
@pytest.mark.parametrize("name", ["MultiSyncDataCollector", "MultiaSyncDataCollector"])
def test_the_older_collector_names_tag_frames_with_published_versions(name):
    import torchrl.collectors

    cls = getattr(torchrl.collectors, name, None)
    if cls is None:
        pytest.skip(f"torchrl {torchrl.__version__} has no {name} (renamed in 0.13)")
    collector = _pendulum_collector(cls)
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
