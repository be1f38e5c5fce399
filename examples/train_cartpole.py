"""DQN on CartPole-v1 with TorchRL's Trainer, a 2-worker collector and shmsync weight sync.

    python examples/train_cartpole.py                  # MultiSyncCollector, until return 195
    python examples/train_cartpole.py --keep-running   # until Ctrl-C: watch it with `shmsync ls NAME --watch`
    python examples/train_cartpole.py --async          # MultiAsyncCollector
    python examples/train_cartpole.py --log-dir runs   # also the policy lag, as CSV, per batch
    python examples/train_cartpole.py --help

At its start it prints its store's name and the command that watches the workers live.

The collector's workers get the trainer's weights through a shared-memory store
(`ShmWeightSyncScheme`); the `UpdateWeights` hook publishes after every batch without
waiting for any worker. Every collected frame carries the version of the weights that
produced it, so the summary can report exact staleness; `LogLag` logs the lag of each batch
and of each worker to the trainer's logger, and the summary ends with the readers' table.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import warnings
from dataclasses import dataclass

import torch
from tensordict.nn import TensorDictSequential
from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer
from torchrl.envs import GymEnv
from torchrl.envs.utils import ExplorationType, set_exploration_type
from torchrl.modules import MLP, EGreedyModule, QValueActor
from torchrl.objectives import DQNLoss, SoftUpdate
from torchrl.record.loggers.csv import CSVLogger
from torchrl.trainers import DefaultOptimizationStepper, Trainer

from shmsync import LogLag, ShmWeightSyncScheme, UpdateWeights, staleness
from shmsync.tools.ctrl_c import CtrlC


@dataclass
class Args:
    total_frames: int = 60_160  # upper bound (a multiple of frames_per_batch); stops at the target
    frames_per_batch: int = 256  # per batch, over all workers
    workers: int = 2
    optim_steps_per_batch: int = 64
    batch_size: int = 128
    lr: float = 1e-3
    gamma: float = 0.99
    tau: float = 0.02  # soft target-network update rate
    eps_frames: int = 10_000  # frames over which epsilon anneals from 1 to eps_end
    eps_end: float = 0.05
    buffer_size: int = 50_000
    eval_every: int = 5  # batches between evaluations
    eval_episodes: int = 5
    target_return: float = 195.0  # stop when the evaluation average reaches it (0: never; run every frame)
    keep_running: bool = False  # train until Ctrl-C (no frame budget, no target), to watch it live
    seed: int = 0
    use_async: bool = False  # MultiAsyncCollector instead of MultiSyncCollector
    scheme: str = "shmsync"  # or "torchrl": TorchRL's default weight sync, for comparison
    private_copy: bool = False  # each worker copies the weights into its own (default: runs them in place)
    progress: bool = True  # a line per evaluation: frames, return, frames per second
    log_dir: str = ""  # write the trainer's scalars (the policy lag too) as CSV under this folder


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for f in dataclasses.fields(Args):
        flag = "--async" if f.name == "use_async" else f"--{f.name.replace('_', '-')}"
        if f.type in ("bool", bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            choices = ("shmsync", "torchrl") if f.name == "scheme" else None
            parser.add_argument(flag, dest=f.name, type=type(f.default), default=f.default, choices=choices)
    return Args(**vars(parser.parse_args(argv)))


def make_env():
    return GymEnv("CartPole-v1")


def evaluate(actor, episodes: int, seed: int) -> float:
    env = make_env()
    env.set_seed(seed)
    returns = []
    with torch.no_grad(), set_exploration_type(ExplorationType.DETERMINISTIC):
        for _ in range(episodes):
            rollout = env.rollout(500, actor, break_when_any_done=True)
            returns.append(rollout["next", "reward"].sum().item())
    env.close()
    return sum(returns) / len(returns)


def say_how_to_watch(name: str) -> None:
    """The store's name is random: print it, and the command that watches its workers."""
    python = os.path.relpath(sys.executable) if sys.executable.startswith(os.getcwd()) else sys.executable
    print(f"store {name}: watch its workers live from another terminal with")
    print(f"  {python} -m shmsync ls {name} --watch")


def main(args: Args) -> dict:
    # A Ctrl-C, at any moment, stops training after the batch at hand; the summary still prints.
    with CtrlC() as ctrl_c:
        kind = "MultiAsyncCollector" if args.use_async else "MultiSyncCollector"
        print(f"DQN on CartPole-v1: {kind}, {args.workers} workers, {args.scheme} weight sync", flush=True)
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        spec = make_env().action_spec

        # Policy: a Q-network, plus epsilon-greedy exploration for the collectors.
        actor = QValueActor(
            MLP(in_features=4, out_features=2, num_cells=[128, 128]), in_keys=["observation"], spec=spec
        )
        greedy = EGreedyModule(spec, annealing_num_steps=args.eps_frames, eps_init=1.0, eps_end=args.eps_end)
        policy = TensorDictSequential(actor, greedy)

        # Workers load `policy` from shared memory and reload only when a new version is published.
        scheme = (
            ShmWeightSyncScheme(zero_copy=False if args.private_copy else None) if args.scheme == "shmsync" else None
        )
        collector_cls = MultiAsyncCollector if args.use_async else MultiSyncCollector
        with ctrl_c.shielded():  # the workers never see Ctrl-C: the trainer stops them
            collector = collector_cls(
                [make_env] * args.workers,
                policy,
                frames_per_batch=args.frames_per_batch,
                total_frames=-1 if args.keep_running else args.total_frames,
                weight_sync_schemes={"policy": scheme} if scheme is not None else None,
            )
        try:
            collector.set_seed(args.seed)  # each worker's env gets its own seed derived from it
            if scheme is not None:
                say_how_to_watch(scheme.store.name)
            budget = "until Ctrl-C" if args.keep_running else f"of at most {args.total_frames}"

            loss = DQNLoss(actor, action_space=spec, delay_value=True)
            loss.make_value_estimator(gamma=args.gamma)
            target_updater = SoftUpdate(loss, tau=args.tau)
            buffer = TensorDictReplayBuffer(storage=LazyTensorStorage(args.buffer_size), batch_size=args.batch_size)
            trainer = Trainer(
                collector=collector,
                # The trainer stops once it collected total_frames: with --keep-running, a count it never reaches.
                total_frames=sys.maxsize if args.keep_running else args.total_frames,
                frame_skip=1,
                optim_steps_per_batch=args.optim_steps_per_batch,
                loss_module=loss,
                optimizer=torch.optim.Adam(loss.parameters(), lr=args.lr),
                optimization_stepper=DefaultOptimizationStepper(),
                target_net_updater=target_updater,
                progress_bar=False,  # one line per evaluation instead (see maybe_evaluate)
                logger=CSVLogger("cartpole", log_dir=args.log_dir) if args.log_dir else None,
                log_interval=1 if args.log_dir else 10**9,
            )
            if scheme is not None:  # the lag of each batch's frames and of each worker, in the logger and progress bar
                LogLag(scheme).register(trainer)

            # The replay buffer, by hand: extend with each batch, sample for each optimizer step.
            stats = {"staleness": [], "versions_per_worker": [set() for _ in range(args.workers)]}

            def record(batch):
                if scheme is not None:
                    stats["staleness"].append(staleness(batch, scheme).flatten())
                if scheme is not None and not args.use_async:  # [workers, time]
                    for w in range(args.workers):
                        stats["versions_per_worker"][w].update(batch["policy_version"][w].unique().tolist())
                greedy.step(batch.numel())
                buffer.extend(batch.reshape(-1))

            trainer.register_op("batch_process", record)
            trainer.register_op("process_optim_batch", lambda _: buffer.sample())
            trainer.register_op("post_optim", target_updater.step)

            # Publish the exploration policy (registered on the trainer) after every batch.
            trainer.register_module("exploration_policy", policy)
            UpdateWeights(collector, 1, weight_update_map={"policy": "exploration_policy"}, trainer=trainer).register(
                trainer
            )

            evals: list[tuple[int, float, float]] = []
            batches = [0]
            clock = [0.0, 0.0]  # when the first and the latest batch came

            def frames_per_second() -> float:
                """Frames collected after the first batch, over the time since it (one figure, everywhere)."""
                return (trainer.collected_frames - args.frames_per_batch) / max(clock[1] - clock[0], 1e-9)

            def maybe_evaluate():
                batches[0] += 1
                clock[1] = time.perf_counter()
                if batches[0] == 1:
                    clock[0] = clock[1]
                if batches[0] % args.eval_every:
                    return
                avg = evaluate(actor, args.eval_episodes, args.seed + 1000 + batches[0])
                evals.append((trainer.collected_frames, avg, clock[1] - start))
                if args.progress:
                    rate = frames_per_second()
                    print(
                        f"frames {trainer.collected_frames:7d} {budget}  eval return {avg:5.0f}  {rate:6.0f} frames/s"
                    )
                if args.target_return and not args.keep_running and avg >= args.target_return:
                    stopped[0] = "target"
                    trainer.request_stop(f"evaluation return {avg:.0f} >= {args.target_return}")

            stopped: list[str | None] = [None]  # "target" once the evaluation reached it
            trainer.register_op("post_steps", maybe_evaluate)
            if (
                scheme is not None
            ):  # every worker as an operator sees it once training stopped, the last update included
                trainer.register_op("shutdown", lambda: stats.update(readers=scheme.readers().format()))
            # After the batch at hand, the trainer stops; the workers and the store shut down.
            ctrl_c.when_pressed(lambda: trainer.request_stop("Ctrl-C"))

            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                warnings.filterwarnings("ignore", "Converting a tensor with requires_grad")  # TorchRL logging its loss
                trainer.train()  # shuts the collector (and its store) down at the end
            total = time.perf_counter() - start
            rate = frames_per_second() if batches[0] > 1 else None  # one batch times nothing
            why = stopped[0] or ("Ctrl-C" if ctrl_c.pressed else None)
            return summarize(args, trainer.collected_frames, total, rate, actor, scheme, stats, evals, why)
        finally:
            collector.shutdown()  # also on errors, or worker processes would keep the program alive


def summarize(
    args: Args,
    frames: int,
    total: float,
    rate: float | None,
    actor,
    scheme,
    stats: dict,
    evals: list,
    stopped: str | None,
) -> dict:
    """Print the run's summary (and the readers' table); return its figures. ``rate``: frames per
    second after the first batch (None: training stopped within it); ``stopped``: why training ended
    before its frame budget ("target", "Ctrl-C"), or None."""
    final = evaluate(actor, 10, args.seed + 999)
    store = scheme.store if scheme is not None else None
    tags = torch.cat(stats["staleness"]) if stats["staleness"] else torch.zeros(1, dtype=torch.long)
    summary = {
        "frames": frames,
        "seconds": total,
        "frames_per_second": rate,
        "final_eval_return": final,
        "target_reached_at": next(((f, t) for f, r, t in evals if r >= args.target_return), None)
        if stopped == "target"
        else None,
        "stopped_by": stopped,
    }
    print("\n--- summary ---")
    private = args.private_copy and args.scheme == "shmsync"
    sync = f"{args.scheme} weight sync" + (", private copies" if private else "")
    collector = "MultiAsyncCollector" if args.use_async else "MultiSyncCollector"
    print(f"collector            {collector}, {args.workers} workers, {sync}")
    speed = f"{rate:.0f} frames/s after the first batch" if rate is not None else "stopped within the first batch"
    print(f"frames               {summary['frames']} in {total:.1f}s ({speed})")
    if store is not None:
        summary.update(
            versions_published=store.version,
            versions_seen_per_worker=None if args.use_async else [len(v) for v in stats["versions_per_worker"]],
            staleness_mean=tags.float().mean().item(),
            staleness_max=int(tags.max()),
            publish_seconds=store.publish_seconds,
            publish_fraction=store.publish_seconds / total,
        )
        last = " (the last one after the final batch)" if summary["versions_published"] else ""
        print(f"versions published   {summary['versions_published']}{last}")
        if summary["versions_seen_per_worker"] is not None:
            seen = summary["versions_seen_per_worker"]
            print(f"versions per worker  {seen} (distinct versions in each worker's frames)")
        print(f"staleness of frames  mean {summary['staleness_mean']:.2f}, max {summary['staleness_max']} versions")
        share = 100 * summary["publish_fraction"]
        print(f"time publishing      {store.publish_seconds * 1e3:.1f} ms ({share:.3f}% of total)")
        if "readers" in stats:
            print(f"readers' table when training stopped:\n{stats['readers']}")
    reached = summary["target_reached_at"]
    if stopped == "Ctrl-C":
        outcome = f"stopped by Ctrl-C after {frames} frames"
    elif reached:
        outcome = f"target {args.target_return:.0f} reached after {reached[0]} frames, {reached[1]:.0f}s"
    else:
        outcome = "no target set" if not args.target_return or args.keep_running else "target not reached"
    print(f"evaluation           final average return {final:.1f} over 10 episodes; {outcome}")
    return summary


if __name__ == "__main__":
    main(parse_args())
