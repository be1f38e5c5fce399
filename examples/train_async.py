"""Asynchronous DQN on CartPole-v1: a MultiAsyncCollector, shmsync weight sync, and TorchRL's
staleness-aware replay.

    python examples/train_async.py
    python examples/train_async.py --max-staleness 16 --help

Workers collect without ever waiting for the trainer; the trainer publishes its weights
after every batch under its optimizer-step count (``update_policy_weights_(version=...)``),
so every frame carries the optimizer step of the weights that produced it. TorchRL's
``StalenessAwareSampler`` then samples only frames at most ``max_staleness`` optimizer
steps old, weighting fresher ones higher.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
import warnings
from dataclasses import dataclass

import torch
from tensordict.nn import TensorDictSequential
from torchrl.collectors import MultiAsyncCollector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.data.replay_buffers.samplers import StalenessAwareSampler
from torchrl.envs import GymEnv
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import MLP, EGreedyModule, QValueActor
from torchrl.objectives import DQNLoss, SoftUpdate

from shmsync import ShmWeightSyncScheme
from shmsync.tools.ctrl_c import CtrlC


@dataclass
class Args:
    total_frames: int = 40_000
    frames_per_batch: int = 128  # per batch (one worker's)
    workers: int = 2
    optim_steps_per_batch: int = 8
    batch_size: int = 128
    max_staleness: int = 64  # optimizer steps; older frames are never sampled
    lr: float = 1e-3
    gamma: float = 0.99
    tau: float = 0.02
    eps_frames: int = 10_000
    eps_end: float = 0.05
    buffer_size: int = 20_000
    eval_every: int = 20  # batches between evaluations
    seed: int = 0


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(Args):
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=type(f.default), default=f.default)
    return Args(**vars(parser.parse_args(argv)))


def make_env():
    return GymEnv("CartPole-v1")


def evaluate(actor, seed: int) -> float:
    env = make_env()
    env.set_seed(seed)
    with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
        ret = env.rollout(500, actor, break_when_any_done=True)["next", "reward"].sum().item()
    env.close()
    return ret


def main(args: Args) -> None:
    with CtrlC() as ctrl_c:  # a Ctrl-C, at any moment, stops after the batch at hand; the summary still prints
        train(args, ctrl_c)


def train(args: Args, ctrl_c: CtrlC) -> None:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    spec = make_env().action_spec
    actor = QValueActor(MLP(in_features=4, out_features=2, num_cells=[64, 64]), in_keys=["observation"], spec=spec)
    explore = EGreedyModule(spec, annealing_num_steps=args.eps_frames, eps_end=args.eps_end)
    policy = TensorDictSequential(actor, explore)

    loss = DQNLoss(actor, action_space=spec, delay_value=True)
    loss.make_value_estimator(gamma=args.gamma)
    target_update = SoftUpdate(loss, tau=args.tau)
    optimizer = torch.optim.Adam(loss.parameters(), lr=args.lr)

    sampler = StalenessAwareSampler(max_staleness=args.max_staleness)
    buffer = TensorDictReplayBuffer(
        storage=LazyTensorStorage(args.buffer_size), sampler=sampler, batch_size=args.batch_size
    )
    with ctrl_c.shielded():  # the workers never see Ctrl-C: the trainer shuts them down
        collector = MultiAsyncCollector(
            [make_env] * args.workers,
            policy,
            frames_per_batch=args.frames_per_batch,
            total_frames=args.total_frames,
            weight_sync_schemes={"policy": ShmWeightSyncScheme()},
        )

    steps, published, frames, newest, skipped, staleness_seen = 0, 0, 0, 0, 0, []
    start = time.perf_counter()
    try:
        collector.set_seed(args.seed)
        for i, batch in enumerate(collector):
            if ctrl_c.pressed:
                break
            batch = batch.reshape(-1)
            frames += batch.numel()
            staleness_seen.append(steps - batch["policy_version"].float().mean().item())
            newest = max(newest, int(batch["policy_version"].max()))
            buffer.extend(batch)
            explore.step(batch.numel())
            for _ in range(args.optim_steps_per_batch):
                sampler.consumer_version = steps  # staleness is counted in optimizer steps
                if steps - newest > args.max_staleness:
                    skipped += 1  # every frame is too old: wait for the workers to catch up
                    break
                loss_vals = loss(buffer.sample())
                optimizer.zero_grad()
                loss_vals["loss"].backward()
                optimizer.step()
                target_update.step()
                steps += 1
            # Publish under the optimizer-step count; workers pick it up at their next rollout.
            if steps > published:  # versions only go up: nothing new, nothing to publish
                collector.update_policy_weights_(version=steps)
                published = steps
            if i % args.eval_every == 0:
                ret = evaluate(actor, args.seed)
                print(f"batch {i:4d}  frames {frames:6d}  optimizer steps {steps:5d}  return {ret:6.1f}")
    finally:
        collector.shutdown()
    elapsed = time.perf_counter() - start
    print(f"frames/s              {frames / elapsed:.0f}")
    print(f"optimizer steps       {steps}")
    print(f"batches with no fresh frames  {skipped}")
    mean = sum(staleness_seen) / len(staleness_seen) if staleness_seen else 0.0
    print(f"staleness of batches  mean {mean:.1f} optimizer steps")
    print(f"final return          {evaluate(actor, args.seed + 1):.1f}")
    print(f"stopped by Ctrl-C after {frames} frames" if ctrl_c.pressed else f"all {frames} frames collected")


if __name__ == "__main__":  # TorchRL spawns its workers: they import this file
    warnings.filterwarnings("ignore", category=UserWarning)
    main(parse_args())
