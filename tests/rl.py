"""Small real TorchRL set-ups shared by the tests (module-level so spawned workers can import them)."""

from __future__ import annotations

import torch
from torchrl.envs import GymEnv
from torchrl.modules import MLP, QValueActor
from torchrl.objectives import DQNLoss


def make_env():
    return GymEnv("CartPole-v1")


def make_pendulum():
    return GymEnv("Pendulum-v1")


def make_policy(seed: int = 0) -> QValueActor:
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


def make_loss(policy) -> DQNLoss:
    return DQNLoss(policy, action_space=make_env().action_spec, delay_value=False)
