"""Default policies for the standalone workers: small MLPs shaped by the environment."""

from __future__ import annotations

import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.data import Categorical, OneHot
from torchrl.envs import EnvBase, GymEnv
from torchrl.modules import MLP, QValueActor


def make_env(name: str) -> EnvBase:
    """A gymnasium environment by id (``"CartPole-v1"``, ``"Pendulum-v1"``...)."""
    return GymEnv(name)


def mlp_policy(env: EnvBase, num_cells: tuple[int, ...] = (64, 64)) -> nn.Module:
    """A Q-network actor for discrete actions, a tanh-squashed deterministic actor otherwise.

    The trainer builds the same policy to create the store, so workers and trainer agree on
    every key, shape and dtype.
    """
    obs_dim = env.observation_spec["observation"].shape[-1]
    spec = env.action_spec
    if isinstance(spec, (OneHot, Categorical)):
        n = spec.space.n
        return QValueActor(
            MLP(in_features=obs_dim, out_features=n, num_cells=list(num_cells)), in_keys=["observation"], spec=spec
        )
    act_dim = spec.shape[-1]
    scale = float(spec.space.high.max())
    net = nn.Sequential(
        MLP(in_features=obs_dim, out_features=act_dim, num_cells=list(num_cells)), nn.Tanh(), _Scale(scale)
    )
    return TensorDictModule(net, in_keys=["observation"], out_keys=["action"])


class _Scale(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def egreedy_policy(env: EnvBase, annealing_num_steps: int = 10_000, eps_end: float = 0.05) -> nn.Module:
    """:func:`mlp_policy` followed by epsilon-greedy exploration (discrete actions).

    Epsilon is a buffer of the module: the trainer anneals it and publishes it with the
    weights, so every worker explores with the trainer's current epsilon.
    """
    from tensordict.nn import TensorDictSequential
    from torchrl.modules import EGreedyModule

    greedy = EGreedyModule(env.action_spec, annealing_num_steps=annealing_num_steps, eps_init=1.0, eps_end=eps_end)
    return TensorDictSequential(mlp_policy(env), greedy)
