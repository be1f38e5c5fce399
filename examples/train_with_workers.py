"""DQN on CartPole-v1 with standalone worker processes that attach to the trainer's store by name.

    python examples/train_with_workers.py

No TorchRL multi-process collector here: `shmsync.workers.launch` starts the processes, each runs a
single-process collector, reloads the policy lazily from shared memory and sends its
batches (tagged with the exact policy version) back through a queue.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass

import torch
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.objectives import DQNLoss, SoftUpdate

from shmsync import WeightStore, staleness
from shmsync.tools.ctrl_c import CtrlC
from shmsync.workers.launch import launch
from shmsync.workers.policies import egreedy_policy, make_env


@dataclass
class Args:
    env: str = "CartPole-v1"
    workers: int = 2
    frames_per_batch: int = 128  # per worker batch
    max_batches: int = 400
    optim_steps_per_batch: int = 32
    batch_size: int = 128
    lr: float = 1e-3
    tau: float = 0.02
    eps_frames: int = 10_000  # epsilon anneals over this many frames (published with the weights)
    target_return: float = 195.0  # stop when the evaluation average reaches it (0: never; run every batch)
    eval_every: int = 10


def parse_args() -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(Args):
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=type(f.default), default=f.default)
    return Args(**vars(parser.parse_args()))


def evaluate(policy, env_name: str, episodes: int = 5) -> float:
    env = make_env(env_name)
    with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
        total = sum(
            env.rollout(500, policy, break_when_any_done=True)["next", "reward"].sum().item() for _ in range(episodes)
        )
    env.close()
    return total / episodes


def main(args: Args) -> None:
    torch.manual_seed(0)
    env = make_env(args.env)
    # The same factory the workers use (--policy below), so the layouts match.
    policy = egreedy_policy(env, annealing_num_steps=args.eps_frames)
    actor, greedy = policy[0], policy[1]
    loss = DQNLoss(actor, action_space=env.action_spec, delay_value=True)
    target = SoftUpdate(loss, tau=args.tau)
    optimizer = torch.optim.Adam(loss.parameters(), lr=args.lr)
    buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(50_000), batch_size=args.batch_size)

    # A Ctrl-C, at any moment, stops after the batch at hand; the summary still prints.
    with CtrlC() as ctrl_c, WeightStore.create(policy) as store:
        print(f"store {store.name}: watch its workers live with  shmsync ls {store.name} --watch")
        start = time.perf_counter()
        frames, stale, outcome = 0, [], "batch budget spent"
        with ctrl_c.shielded():  # the workers never see Ctrl-C: the pool stops them
            pool = launch(
                store.name,
                args.workers,
                args.env,
                frames_per_batch=args.frames_per_batch,
                policy="shmsync.workers.policies:egreedy_policy",
            )
        with pool:
            for i, (_worker, batch) in enumerate(pool.batches(args.max_batches)):
                stale.append(staleness(batch, store))
                greedy.step(batch.numel())
                buffer.extend(batch)
                frames += batch.numel()
                for _ in range(args.optim_steps_per_batch):
                    losses = loss(buffer.sample())
                    optimizer.zero_grad()
                    losses["loss"].backward()
                    optimizer.step()
                    target.step()
                store.publish(policy)  # a snapshot: the next step may write the weights at once
                if ctrl_c.pressed:
                    outcome = f"stopped by Ctrl-C after {frames} frames"
                    break
                if (i + 1) % args.eval_every == 0:
                    score = evaluate(actor, args.env)
                    print(f"batch {i + 1:4d}  frames {frames:6d}  version {store.version:4d}  eval return {score:6.1f}")
                    if args.target_return and score >= args.target_return:
                        outcome = f"target {args.target_return:.0f} reached"
                        break
        seconds = time.perf_counter() - start
        s = torch.cat(stale).float() if stale else torch.zeros(1)
        versions = f"{store.version} versions published; reloads per worker {pool.reloads}"
        print(f"\n{frames} frames in {seconds:.1f}s; {versions}")
        final = evaluate(actor, args.env, 10)
        print(f"staleness of frames: mean {s.mean():.2f}, max {s.max():.0f}; final eval return {final:.1f}; {outcome}")


if __name__ == "__main__":
    main(parse_args())
