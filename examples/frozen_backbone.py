"""A policy with a large frozen backbone and a small trained head, synced by shmsync: each publish
copies what changed, and every batch runs exactly the version on its tag.

    python examples/frozen_backbone.py
    python examples/frozen_backbone.py --backbone-mb 128 --batches 40 --help

A stand-in for fine-tuning a pretrained model: a Pendulum actor whose backbone (a pretrained
encoder, frozen) is ``--backbone-mb`` of weights and whose head an optimizer trains at every batch,
in the loop of TorchRL's off-policy scripts (update, then train). Every ``--refresh-every`` batches
a frozen reference copy of the head is refreshed (``load_state_dict``, as a KL-regularized
fine-tune refreshes its reference policy): frozen, yet not static; it is published then, and only
then. Per batch the example prints the version the frames ran, how many optimizer steps behind
the trainer that was, and what the last publish copied and skipped; each frame also reports the
head's first bias, which must be that version's.
"""

from __future__ import annotations

import argparse
import dataclasses
import warnings
from dataclasses import dataclass

import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors import MultiSyncCollector
from torchrl.envs import GymEnv

from shmsync import ShmWeightSyncScheme, staleness
from shmsync.core.header import Proof
from shmsync.tools.ctrl_c import CtrlC


@dataclass
class Args:
    backbone_mb: int = 32  # the frozen part's weights
    batches: int = 20
    frames_per_batch: int = 64
    workers: int = 2
    optim_steps_per_batch: int = 4
    refresh_every: int = 8  # batches between refreshes of the frozen reference copy
    lr: float = 1e-3
    seed: int = 0


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(Args):
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=type(f.default), default=f.default)
    return Args(**vars(parser.parse_args(argv)))


class Actor(nn.Module):
    """A frozen backbone (its first layer ``width`` wide), a trained head and a frozen reference
    copy of the head; each frame also reports the head's first bias."""

    def __init__(self, backbone_mb: int) -> None:
        super().__init__()
        width = max(16, backbone_mb * (1 << 20) // 4 // 256)  # width x 256 floats: the backbone's weights
        self.backbone = nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.Linear(width, 256), nn.Tanh())
        self.head = nn.Linear(256, 1)
        self.reference = nn.Linear(256, 1)
        for module in (self.backbone, self.reference):
            module.requires_grad_(False)

    def forward(self, observation: torch.Tensor):
        features = self.backbone(observation)
        action = 2 * torch.tanh(self.head(features))
        return action, self.head.bias.detach()[0].expand(observation.shape[:-1]).clone()


def make_env():
    return GymEnv("Pendulum-v1")


def main(args: Args) -> None:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    actor = Actor(args.backbone_mb)
    policy = TensorDictModule(actor, in_keys=["observation"], out_keys=["action", "head_bias"])
    optimizer = torch.optim.Adam(actor.head.parameters(), lr=args.lr)
    scheme = ShmWeightSyncScheme()
    with CtrlC() as ctrl_c:
        with ctrl_c.shielded():  # the workers never see Ctrl-C: the trainer shuts them down
            collector = MultiSyncCollector(
                [make_env] * args.workers,
                policy,
                frames_per_batch=args.frames_per_batch,
                total_frames=-1,
                weight_sync_schemes={"policy": scheme},
            )
        copied = skipped = exact = 0
        try:
            for i, batch in enumerate(collector):
                if i >= args.batches or ctrl_c.pressed:
                    break
                exact += check_exact(batch, scheme)
                behind = int(staleness(batch, scheme, unit="optim_steps").max())
                info = scheme.store.info()
                copied += info["copied_bytes"]
                skipped += info["skipped_bytes"]
                print(
                    f"batch {i:3d}  version {int(batch['policy_version'].max()):3d}  {behind} optimizer steps behind  "
                    f"last publish copied {info['copied_bytes'] / 2**10:8.1f} KiB, skipped "
                    f"{info['skipped_bytes'] / 2**20:6.1f} MiB ({Proof.of_word(info['unchanged_proof'])})"
                )
                collector.update_policy_weights_()  # as td3.py: update, then train on the batch
                train(actor, optimizer, batch, args.optim_steps_per_batch)
                if (i + 1) % args.refresh_every == 0:
                    actor.reference.load_state_dict(actor.head.state_dict())  # frozen, refreshed now and then
        finally:
            collector.shutdown()
    total = copied + skipped
    print(f"batches that ran exactly their version's weights  {exact} of {min(i, args.batches)}")
    print(f"publishes copied {copied / 2**20:.1f} MiB of {total / 2**20:.1f} MiB ({copied / max(total, 1):.1%})")


def train(actor: Actor, optimizer: torch.optim.Optimizer, batch, steps: int) -> None:
    """A few optimizer steps on the head: steer the pendulum's actions toward a damping controller."""
    observation = batch["observation"].reshape(-1, 3)
    target = (-2.0 * observation[:, 2:3]).clamp(-2, 2)  # push against the angular velocity
    for _ in range(steps):
        optimizer.zero_grad()
        action, _ = actor(observation)
        nn.functional.mse_loss(action, target).backward()
        optimizer.step()


def check_exact(batch, scheme: ShmWeightSyncScheme) -> bool:
    """Whether every frame ran one version, the newest, and its head bias is that version's."""
    versions = set(batch["policy_version"].flatten().tolist())
    newest = scheme.store.snapshot()
    bias = float(newest.weights["policy", "module", "head", "bias"][0])
    return versions == {newest.version} and set(batch["head_bias"].flatten().tolist()) == {bias}


if __name__ == "__main__":  # TorchRL spawns its workers: they import this file
    warnings.filterwarnings("ignore", category=UserWarning)
    main(parse_args())
