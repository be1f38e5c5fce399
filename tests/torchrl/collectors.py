"""Small real TorchRL set-ups: environments, policies whose output names their weights (a frame
shows which version ran), trainers and losses, and collector classes that act as a TorchRL
release that changed would. Module-level, so that TorchRL's workers import them by name."""

from __future__ import annotations

import functools

import torch
import torchrl.collectors
from tensordict import TensorDict

# QValueActor's one-hot action when both Q-values are equal (all its weights zero).
TIE = torch.tensor([1, 1])


def make_env():
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1")


def make_pendulum():
    from torchrl.envs import GymEnv

    return GymEnv("Pendulum-v1")


def make_policy(seed: int = 0):
    from torchrl.modules import MLP, QValueActor

    torch.manual_seed(seed)
    env_spec = make_env().action_spec
    return QValueActor(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"], spec=env_spec)


def make_trainer(collector, loss, total_frames: int, optim_steps_per_batch: int = 2):
    from torchrl.trainers import Trainer

    return Trainer(
        collector=collector,
        total_frames=total_frames,
        frame_skip=1,
        optim_steps_per_batch=optim_steps_per_batch,
        loss_module=loss,
        optimizer=torch.optim.Adam(loss.parameters(), 1e-3),
        progress_bar=False,
    )


def make_loss(policy):
    from torchrl.objectives import DQNLoss

    return DQNLoss(policy, action_space=make_env().action_spec, delay_value=False)


def make_normed_env():
    """CartPole whose observations pass through an ObservationNorm (a module with buffers)."""
    from torchrl.envs import ObservationNorm, TransformedEnv

    return TransformedEnv(make_env(), ObservationNorm(loc=torch.zeros(4), scale=torch.ones(4), in_keys=["observation"]))


class WeightProbe(torch.nn.Module):
    """A Pendulum policy that reports, per frame, the min and max over all of its weights.

    When every weight of a version is filled with that version's number, a frame produced by
    one complete version has ``lo == hi == version``; a mix of two versions cannot.
    """

    def __init__(self, big: int = 512):
        super().__init__()
        self.big = torch.nn.Parameter(torch.zeros(big, big))
        self.small = torch.nn.Parameter(torch.zeros(1000))

    def forward(self, observation):
        with torch.no_grad():
            lo = torch.minimum(self.big.min(), self.small.min())
            hi = torch.maximum(self.big.max(), self.small.max())
        batch = observation.shape[:-1]
        return torch.zeros(*batch, 1), lo.expand(batch).clone(), hi.expand(batch).clone()


def make_probe_policy(big: int = 512):
    """A :class:`WeightProbe` as a TorchRL policy; ``big``: the side of its square parameter."""
    from tensordict.nn import TensorDictModule

    return TensorDictModule(WeightProbe(big), in_keys=["observation"], out_keys=["action", "w_lo", "w_hi"])


class FrozenProbe(torch.nn.Module):
    """A Pendulum policy with a large frozen part (1 MiB) and a small trained head: it reports, per
    frame, the min and max of its head (filled with a version's number, one complete version shows
    one value) and the sum of its frozen part's bytes (any change to it shows)."""

    def __init__(self, frozen: int = 512):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.frozen = torch.nn.Parameter(torch.randn(frozen, frozen, generator=generator), requires_grad=False)
        self.head = torch.nn.Parameter(torch.zeros(1000))

    def forward(self, observation):
        with torch.no_grad():
            lo, hi = self.head.min(), self.head.max()
            check = self.frozen.view(torch.int32).to(torch.int64).sum().to(torch.float64)
        batch = observation.shape[:-1]
        return torch.zeros(*batch, 1), lo.expand(batch).clone(), hi.expand(batch).clone(), check.expand(batch).clone()


def make_frozen_probe_policy():
    """A :class:`FrozenProbe` as a TorchRL policy."""
    from tensordict.nn import TensorDictModule

    return TensorDictModule(FrozenProbe(), in_keys=["observation"], out_keys=["action", "w_lo", "w_hi", "frozen_sum"])


def make_marked_env():
    """CartPole whose observations are shifted by +100, so a batch tells which worker made it."""
    from torchrl.envs import ObservationNorm, TransformedEnv

    return TransformedEnv(
        make_env(), ObservationNorm(loc=torch.full((4,), 100.0), scale=torch.ones(4), in_keys=["observation"])
    )


def make_marked_pendulum():
    """Pendulum whose observations are shifted by +100, so a batch tells which node made it."""
    from torchrl.envs import ObservationNorm, TransformedEnv

    return TransformedEnv(
        make_pendulum(), ObservationNorm(loc=torch.full((3,), 100.0), scale=torch.ones(3), in_keys=["observation"])
    )


def fork_collector_check() -> None:
    """Run in a fresh interpreter: a MultiSyncCollector with the fork start method."""
    import torch.multiprocessing as mp

    mp.set_start_method("fork", force=True)
    from torchrl.collectors import MultiSyncCollector

    from shmsync import ShmWeightSyncScheme

    policy = make_policy()
    scheme = ShmWeightSyncScheme()
    collector = MultiSyncCollector(
        [make_env] * 2, policy, frames_per_batch=40, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    try:
        it = iter(collector)
        assert (next(it)["policy_version"] == 0).all()
        with torch.no_grad():
            for p in policy.parameters():
                p.zero_()
        collector.update_policy_weights_()
        batch = next(it)
        assert (batch["policy_version"] == 1).all() and (batch["action"] == 1).all()
    finally:
        collector.shutdown()
    print("fork ok")


def make_linear_policy(bias: float = 0.0):
    """A Pendulum policy whose action is ``bias`` while its weight is zero: actions name the weights."""
    from tensordict.nn import TensorDictModule

    module = torch.nn.Linear(3, 1)
    with torch.no_grad():
        module.weight.zero_()
        module.bias.fill_(bias)
    return TensorDictModule(module, in_keys=["observation"], out_keys=["action"])


def linear_weights(bias: float):
    """Weights for ``make_linear_policy`` that make every action ``bias``."""

    return TensorDict({"module": {"weight": torch.zeros(1, 3), "bias": torch.full((1,), float(bias))}})


class ScaledLinear(torch.nn.Module):
    """A Pendulum policy with a buffer: action = bias * scale (weight zero), so buffers show in actions."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)
        self.register_buffer("scale", torch.ones(1))
        with torch.no_grad():
            self.linear.weight.zero_()
            self.linear.bias.fill_(0.5)

    def forward(self, observation):
        return self.linear(observation) * self.scale


def make_scaled_policy():
    from tensordict.nn import TensorDictModule

    return TensorDictModule(ScaledLinear(), in_keys=["observation"], out_keys=["action"])


# Hooks a user assigns after construction: the pre-collect hook counts rollouts in the worker,
# the post-collect hook writes that count into the batch's rewards (in place: new keys added
# after the first batch do not reach the trainer through the collector's shared buffers).
ROLLOUTS = [0]


def count_rollouts():
    ROLLOUTS[0] += 1


def write_rollout_count(batch):
    batch["next", "reward"].fill_(float(ROLLOUTS[0]))


def pendulum_collector(cls, frames_per_batch=40, **kwargs):
    """An unbounded 2-worker collector of Pendulum, its policy's weights all zero, synced by shmsync."""
    from shmsync import ShmWeightSyncScheme

    return cls(
        [make_pendulum] * 2,
        make_linear_policy(0.0),
        frames_per_batch=frames_per_batch,
        total_frames=-1,
        weight_sync_schemes={"policy": ShmWeightSyncScheme()},
        **kwargs,
    )


# The single-process collector every TorchRL worker runs (SyncDataCollector before torchrl 0.13).
_WorkerCollector = getattr(torchrl.collectors, "Collector", None) or torchrl.collectors.SyncDataCollector


class RolloutCannotBeShadowed(_WorkerCollector):
    """A worker collector whose rollout an instance attribute cannot shadow: what shmsync sees
    if TorchRL stops calling ``self.rollout()`` from its worker loop."""

    @property
    def rollout(self):
        return functools.partial(_WorkerCollector.rollout, self)


class PolicyHooksBypassed(_WorkerCollector):
    """A worker collector that runs its policy without any module hook: what shmsync sees if
    TorchRL calls the policy another way than through ``nn.Module.__call__``."""

    def rollout(self, *args, **kwargs):
        for module in self.policy.modules():
            module._forward_pre_hooks.clear()
            module._forward_hooks.clear()
        return super().rollout(*args, **kwargs)


def free_ports(n: int = 3) -> int:
    """A port p with p .. p+n-1 free (TorchRL's distributed collectors use tcp_port, +1 and +2)."""
    import socket

    for _ in range(100):
        with socket.socket() as s:
            s.bind(("", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as t:
                    t.bind(("", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free block of ports")
