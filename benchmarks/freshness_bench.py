"""How fresh each batch's weights are, in the loop shapes of TorchRL's own scripts, side by side
with TorchRL's default scheme.

    python benchmarks/freshness_bench.py            # both call orders, 2 workers, 12 batches each
    python benchmarks/freshness_bench.py --docs     # also write docs/results/freshness_bench.md

TorchRL's off-policy scripts (``sac.py``, ``td3.py``, ``ddpg.py``, ...) call
``collector.update_policy_weights_()`` as soon as a batch arrives, then train on it; its on-policy
ones (``ppo.py``, ``dqn.py``) train, then update. Here a ``MultiSyncCollector`` on Pendulum runs
each loop with a real optimizer (Adam, three steps per batch on a loss of the batch), once with
TorchRL's default scheme (``SharedMemWeightSyncScheme``, chosen by TorchRL for an ``nn.Module``
policy) and once with ``ShmWeightSyncScheme()``, taking turns batch by batch.

The policy reports, in each frame, one of its weights (the output layer's bias): an Adam step
moves it every time, so the trainer's record of it after each step tells which step's weights a
frame ran, for either scheme. Reported per loop: the optimizer steps behind the trainer each
batch's frames were (when the batch arrived), for both schemes, shmsync's own count
(``staleness(batch, scheme, unit="optim_steps")``), whether every frame ran one state of the
weights, and the loop per batch.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import warnings

import torch
from tensordict.nn import TensorDictModule
from torch import nn

# The code this benchmark's results measure (benchmarks/provenance.py).
MEASURES = [
    "benchmarks/freshness_bench.py",
    "shmsync/torchrl",
    "shmsync/writer",
    "shmsync/reader",
    "shmsync/store",
    "shmsync/core",
]

warnings.filterwarnings("ignore")
os.environ.setdefault("RL_WARNINGS", "False")

ORDERS = ("update, then train", "train, then update")
KINDS = ("default", "shmsync")
STEPS_PER_BATCH = 3


class Probe(nn.Module):
    """A Pendulum policy (an MLP) that also reports, per frame, its output layer's bias."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, observation: torch.Tensor):
        action = 2 * torch.tanh(self.net(observation))
        probe = self.net[2].bias.detach()[0].expand(observation.shape[:-1]).clone()
        return action, probe


def make_policy() -> TensorDictModule:
    torch.manual_seed(0)
    return TensorDictModule(Probe(), in_keys=["observation"], out_keys=["action", "probe"])


def make_env():
    from torchrl.envs import GymEnv

    return GymEnv("Pendulum-v1")


class Loop:
    """One collector of ``kind`` and its trainer: the collector's policy, trained by Adam."""

    def __init__(self, kind: str, frames: int, workers: int) -> None:
        from torchrl.collectors import MultiSyncCollector

        from shmsync import ShmWeightSyncScheme

        self.policy = make_policy()
        self.scheme = ShmWeightSyncScheme() if kind == "shmsync" else None
        self.collector = MultiSyncCollector(
            [make_env] * workers,
            self.policy,
            frames_per_batch=frames,
            total_frames=-1,
            weight_sync_schemes={"policy": self.scheme} if self.scheme is not None else None,
        )
        self.batches = iter(self.collector)
        self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=1e-2)
        self.history = [float(self.policy.module.net[2].bias)]  # the probe after each optimizer step
        self.rows: list[dict] = []

    def train(self, batch) -> None:
        observation = batch["observation"].reshape(-1, 3)
        for _ in range(STEPS_PER_BATCH):
            self.optimizer.zero_grad()
            self.policy.module.net(observation).pow(2).mean().add(1.0).backward()
            self.optimizer.step()
            self.history.append(float(self.policy.module.net[2].bias))

    def batch(self, order: str) -> None:
        """Take one batch, measure it, then update and train in ``order``."""
        start = time.perf_counter()
        batch = next(self.batches)
        took = time.perf_counter() - start
        probes = set(batch["probe"].flatten().tolist())
        now = len(self.history) - 1
        ran = [now - max(i for i, v in enumerate(self.history) if v == p) for p in probes if p in self.history]
        row = {"behind": max(ran) if len(ran) == len(probes) else None, "whole": len(probes) == 1, "took": took}
        if self.scheme is not None:
            from shmsync import staleness

            counted = staleness(batch, self.scheme, unit="optim_steps")
            row["counted"] = int(counted.max())
            row["tags"] = len(set(batch["policy_version"].flatten().tolist()))
        self.rows.append(row)
        start = time.perf_counter()
        if order == ORDERS[0]:
            self.collector.update_policy_weights_()
            self.train(batch)
        else:
            self.train(batch)
            self.collector.update_policy_weights_()
        row["took"] += time.perf_counter() - start

    def close(self) -> None:
        self.collector.shutdown()


def run(order: str, batches: int, frames: int, workers: int) -> dict[str, list[dict]]:
    loops = {kind: Loop(kind, frames, workers) for kind in KINDS}
    try:
        for _ in range(batches):
            for loop in loops.values():
                loop.batch(order)
    finally:
        for loop in loops.values():
            loop.close()
    return {kind: loop.rows[1:] for kind, loop in loops.items()}  # the first batch ran the first weights


def render(results: dict[str, dict[str, list[dict]]], machine: dict, args: argparse.Namespace) -> str:
    lines = [
        f"{machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, torchrl {machine['torchrl']}; "
        f"MultiSyncCollector on Pendulum, {args.workers} workers, {args.frames} frames per batch, Adam, "
        f"{STEPS_PER_BATCH} optimizer steps per batch, {args.batches - 1} batches per loop after the first; "
        "steps behind: optimizer steps the trainer had taken since the weights a batch ran (0: the newest)",
        "",
        "| call order (as in) | scheme | steps behind, per batch | every frame one state | shmsync's count "
        "| loop per batch (median) |",
        "|---|---|---|---|---|---|",
    ]
    scripts = {ORDERS[0]: "sac.py, td3.py, ddpg.py", ORDERS[1]: "ppo.py, dqn.py"}
    for order, by_kind in results.items():
        for kind, rows in by_kind.items():
            behind = ", ".join("?" if r["behind"] is None else str(r["behind"]) for r in rows)
            whole = f"{sum(r['whole'] for r in rows)} of {len(rows)} batches"
            counted = ", ".join(str(r["counted"]) for r in rows) if kind == "shmsync" else "-"
            loop = statistics.median(r["took"] for r in rows) * 1e3
            name = "TorchRL's default (SharedMem)" if kind == "default" else "shmsync"
            lines.append(f"| {order} ({scripts[order]}) | {name} | {behind} | {whole} | {counted} | {loop:.1f} ms |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=12, help="batches per loop (default 12)")
    parser.add_argument("--frames", type=int, default=64, help="frames per batch (default 64)")
    parser.add_argument("--workers", type=int, default=2, help="workers per collector (default 2)")
    parser.add_argument("--orders", default="both", help="'update-first', 'train-first' or 'both'")
    parser.add_argument("--docs", action="store_true", help="also write docs/results/freshness_bench.md")
    args = parser.parse_args(argv)
    orders = {"update-first": ORDERS[:1], "train-first": ORDERS[1:], "both": ORDERS}[args.orders]
    import torchrl

    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torchrl": torchrl.__version__,
    }
    results = {order: run(order, args.batches, args.frames, args.workers) for order in orders}
    text = render(results, machine, args)
    print(text)
    if args.docs:
        from provenance import write

        write("freshness_bench", text, MEASURES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
