"""UpdateWeights with a real TorchRL Trainer and collector."""

import pytest
import torch
import torchrl.trainers
from torchrl.collectors import Collector

from shmsync import UpdateWeights, WeightMismatchError, WeightReader, WeightSender
from shmsync.torchrl.compat import TORCHRL_VERSION
from tests.torchrl.collectors import make_env, make_loss, make_policy, make_trainer

# TorchRL's own hook and trainer, on every minor: each test's outcome depends on TorchRL's release.
pytestmark = [pytest.mark.slow, pytest.mark.torchrl, pytest.mark.minors]


def _trainer(batches=4, frames_per_batch=20, optim_steps=3):
    policy = make_policy()
    collector = Collector(make_env, policy, frames_per_batch=frames_per_batch, total_frames=batches * frames_per_batch)
    trainer = make_trainer(collector, make_loss(policy), batches * frames_per_batch, optim_steps)
    return trainer, policy


@pytest.mark.timeout(60)
@pytest.mark.parametrize("unit,interval,expected", [("optim_steps", 2, 6), ("batches", 2, 2), ("batches", 1, 4)])
def test_hook_publishes_each_interval(store_factory, unit, interval, expected):
    trainer, policy = _trainer()
    store = store_factory({"policy": policy})
    published = []
    hook = UpdateWeights(
        update_weights_interval=interval,
        trainer=trainer,
        sender=WeightSender(store, {"policy": "loss_module.value_network"}, root=trainer),
        interval_unit=unit,
    )
    hook.register(trainer)
    trainer.register_op(
        "post_optim" if unit == "optim_steps" else "post_steps", lambda: published.append(store.version)
    )
    trainer.train()
    assert store.version == expected
    assert published == sorted(published)
    # What the store holds is the trained policy.
    worker = make_policy(seed=1)
    WeightReader(store, worker).poll()
    if unit == "batches" and interval == 1:
        for a, b in zip(worker.parameters(), policy.parameters()):
            torch.testing.assert_close(a, b)


def test_hook_registers_at_the_right_stage():
    trainer, _ = _trainer()
    for unit, stage in [("batches", "post_steps"), ("optim_steps", "post_optim")]:
        hook = UpdateWeights(trainer.collector, 1, trainer=trainer, interval_unit=unit)
        before = len(getattr(trainer, f"_{stage}_ops"))
        hook.register(trainer, name=f"uw_{unit}")
        assert len(getattr(trainer, f"_{stage}_ops")) == before + 1
        assert trainer._modules[f"uw_{unit}"] is hook
    assert isinstance(hook, torchrl.trainers.UpdateWeights)


def test_state_dict_round_trip(store_factory):
    trainer, policy = _trainer()
    store = store_factory(policy)
    hook = UpdateWeights(
        update_weights_interval=3, trainer=trainer, sender=WeightSender(store, policy), interval_unit="optim_steps"
    )
    trainer._optim_count = 7
    hook()
    assert hook.state_dict() == {"counter": 0, "last_update_count": 7}
    other = UpdateWeights(
        update_weights_interval=3, trainer=trainer, sender=WeightSender(store, policy), interval_unit="optim_steps"
    )
    other.load_state_dict(hook.state_dict())
    trainer._optim_count = 9
    other()
    assert store.version == 1  # 9 - 7 < 3: no publish
    trainer._optim_count = 10
    other()
    assert store.version == 2
    b = UpdateWeights(trainer.collector, 2)
    b(), b(), b()
    assert b.state_dict()["counter"] == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(update_weights_interval=0, collector="c"),
        dict(interval_unit="epochs", collector="c"),
        dict(),
        dict(collector="c", weight_update_map={"policy": "x"}),
        dict(collector="c", interval_unit="optim_steps"),
        dict(sender="s", weight_update_map={"policy": "x"}, trainer="t"),
    ],
)
def test_validation_errors_match_torchrl(kwargs):
    with pytest.raises(ValueError) as ours:
        UpdateWeights(**kwargs)
    if TORCHRL_VERSION < (0, 14):
        return  # torchrl <= 0.13's hook has none of these arguments: shmsync's follows 0.14's
    with pytest.raises(ValueError) as theirs:
        torchrl.trainers.UpdateWeights(**kwargs)
    assert str(ours.value) == str(theirs.value)


def test_paths_resolve_subscripts_and_registered_modules(store_factory):
    trainer, policy = _trainer()
    behaviour = make_policy(seed=3)
    trainer.register_module("behaviour", behaviour)
    mlp = policy.module[0]
    store = store_factory({"mlp": mlp, "behaviour": behaviour, "again": behaviour})
    sender = WeightSender(
        store,
        {"mlp": "loss_module.value_network.module[0]", "behaviour": "behaviour", "again": "_modules['behaviour']"},
        root=trainer,
    )
    with torch.no_grad():
        for p in behaviour.parameters():
            p.fill_(0.5)
    assert sender.update_weights() == 1
    snap = store.snapshot().weights
    assert (snap["behaviour"] == 0.5).all() and (snap["again"] == 0.5).all()
    torch.testing.assert_close(snap["mlp"]["module", "0", "weight"], mlp.module[0].weight.detach())


def test_bad_path_is_reported_before_anything_changes(store_factory):
    trainer, policy = _trainer()
    store = store_factory({"policy": policy})
    with pytest.raises(AttributeError, match=r"path 'loss_module\.actor_network' does not resolve: 'loss_module'"):
        UpdateWeights(trainer.collector, 1, weight_update_map={"policy": "loss_module.actor_network"}, trainer=trainer)
    with pytest.raises(AttributeError, match=r"has no item 5"):
        WeightSender(store, {"policy": "loss_module.value_network.module[5]"}, root=trainer)
    assert store.version == 0


def test_a_sender_that_does_not_match_its_store_fails_when_built(store_factory):
    trainer, policy = _trainer()
    single = store_factory(policy)  # created from the module itself: no destinations
    with pytest.raises(WeightMismatchError, match=r"created from a single module, without destinations.*\['policy'\]"):
        WeightSender(single, {"policy": "loss_module.value_network"}, root=trainer)
    mapped = store_factory({"policy": policy})
    with pytest.raises(WeightMismatchError, match=r"holds destinations \['policy'\], got \['actor'\]"):
        WeightSender(mapped, {"actor": "loss_module.value_network"}, root=trainer)
    with pytest.raises(WeightMismatchError, match="do not have the store's keys"):
        WeightSender(mapped, {"policy": "loss_module.value_network.module[0]"}, root=trainer)
    assert single.version == mapped.version == 0
    WeightSender(single, policy)  # the module itself: fine


def test_hook_destination_without_a_scheme_fails_when_built():
    from torchrl.collectors import MultiSyncCollector

    from shmsync import ShmWeightSyncScheme

    policy = make_policy()
    collector = MultiSyncCollector(
        [make_env], policy, frames_per_batch=20, total_frames=-1, weight_sync_schemes={"policy": ShmWeightSyncScheme()}
    )
    try:
        trainer = make_trainer(collector, make_loss(policy), 100)
        with pytest.raises(ValueError, match=r"destination 'actor' has no weight sync scheme.*\['policy'\]"):
            UpdateWeights(collector, 1, weight_update_map={"actor": "loss_module.value_network"}, trainer=trainer)
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
        versioning="optim_steps",
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
    with pytest.raises(ValueError, match="versioning='optim_steps' needs"):
        UpdateWeights(collector, 1, trainer=trainer, versioning="optim_steps")
    with pytest.raises(ValueError, match="versioning must be 'publishes' or 'optim_steps'"):
        UpdateWeights(collector, 1, trainer=trainer, versioning="frames")
    with pytest.warns(DeprecationWarning, match=r"UpdateWeights\(version=...\) is deprecated"):
        assert UpdateWeights(collector, 1, trainer=trainer, version="publishes").versioning == "publishes"
