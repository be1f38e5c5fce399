"""Memory of the weights per scheme, as ``htop`` or a dashboard sees it, side by side in one run.

    python benchmarks/memory_bench.py                     # 100 MB MLP, 4 and 16 workers: ~10 min on 2 cores
    python benchmarks/memory_bench.py --workers 4 --mb 16 # quicker
    python benchmarks/memory_bench.py --docs              # also writes docs/results/memory_bench.md

A ``MultiSyncCollector`` on Pendulum runs an MLP policy of ``--mb`` MB (float32) with each scheme:
shmsync's default (CPU workers run on the published memory in place), shmsync with private copies
(``zero_copy=False``), and TorchRL's ``SharedMemWeightSyncScheme`` and
``MultiProcessWeightSyncScheme``. After a few batches, each publishing, it reads for the trainer and
every worker process: PSS (proportional set size: shared pages split between their users, so the
sum over processes is what the machine holds) and USS (each worker's private memory), and the
growth of ``/dev/shm``. Each figure is net of the same run with a tiny MLP, in multiples of the
model. What the updates cost in time is ``loop_bench.py``'s to say: the whole loop, side by side.

Last, the trainer writes its weights in place without publishing (its last bias to +1000, which
saturates every action at 2.0), and one more batch is collected: "runs unpublished writes" says
whether the workers ran them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch
from torch import nn

# The code this benchmark's results measure (benchmarks/provenance.py).
MEASURES = [
    "benchmarks/memory_bench.py",
    "shmsync/torchrl",
    "shmsync/writer",
    "shmsync/reader",
    "shmsync/store",
    "shmsync/core",
]

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
SCHEMES = ("shmsync", "shmsync private copy", "SharedMem", "MultiProcess")


@dataclass
class Args:
    workers: tuple[int, ...] = (4, 16)
    mb: float = 100.0
    batches: int = 5
    schemes: tuple[str, ...] = SCHEMES
    docs: bool = False


class MLP(nn.Module):
    """3 -> hidden -> hidden -> 1, sized to about ``nbytes`` of float32 parameters."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        hidden = max(4, int((nbytes / 4) ** 0.5))
        self.net = nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh())
        self.out = nn.Linear(hidden, 1)

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return 2 * torch.tanh(self.out(self.net(observation)))


def make_env():
    from torchrl.envs import GymEnv

    return GymEnv("Pendulum-v1")


def make_scheme(kind: str):
    if kind.startswith("shmsync"):
        from shmsync import ShmWeightSyncScheme

        return ShmWeightSyncScheme(zero_copy=False if kind == "shmsync private copy" else None)
    from torchrl.weight_update import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme

    return {"SharedMem": SharedMemWeightSyncScheme, "MultiProcess": MultiProcessWeightSyncScheme}[kind]()


def shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def measure(kind: str, nbytes: int, workers: int, batches: int) -> dict:
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import MultiSyncCollector

    torch.manual_seed(0)
    policy = TensorDictModule(MLP(nbytes), in_keys=["observation"], out_keys=["action"])
    model_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    shm_before = shm_used()
    collector = MultiSyncCollector(
        [make_env] * workers,
        policy,
        frames_per_batch=20 * workers,
        total_frames=-1,
        weight_sync_schemes={"policy": make_scheme(kind)},
    )
    try:
        batches_of = iter(collector)  # one iterator: a MultiSyncCollector's is not restartable
        for _ in range(batches):
            next(batches_of)
            with torch.no_grad():
                for p in policy.parameters():
                    p.mul_(0.999)  # a training step's change
            collector.update_policy_weights_()
        next(batches_of)  # every worker has loaded the last publish
        time.sleep(0.5)
        me = psutil.Process()
        procs = [me, *me.children(recursive=True)]
        pss = uss = 0
        worker_uss = []
        for proc in procs:
            try:
                info = proc.memory_full_info()
            except psutil.Error:
                continue
            pss += info.pss
            uss += info.uss
            if proc.pid != me.pid:
                worker_uss.append(info.uss)
        shm = shm_used() - shm_before
        # An unpublished in-place write in the trainer: do the workers run it?
        with torch.no_grad():
            policy.module.out.bias.fill_(1000.0)
        batch = next(batches_of)
        unpublished = bool((batch["action"] == 2.0).all())
    finally:
        collector.shutdown()
    return {
        "scheme": kind,
        "workers": workers,
        "model_bytes": model_bytes,
        "pss": pss,
        "worker_uss_mean": statistics.fmean(sorted(worker_uss)[-workers:]) if worker_uss else 0,
        "shm": shm,
        "runs_unpublished": unpublished,
    }


def measured(kind: str, nbytes: int, workers: int, batches: int) -> dict:
    """:func:`measure` in a fresh process: memory left over by an earlier run counts in none."""
    argv = [sys.executable, __file__, "--measure", kind, str(nbytes), str(workers), str(batches)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=1800).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(args: Args) -> dict:
    nbytes = int(args.mb * (1 << 20))
    rows = []
    for workers in args.workers:
        for kind in args.schemes:
            tiny = measured(kind, 4 << 10, workers, args.batches)
            big = measured(kind, nbytes, workers, args.batches)
            m = big["model_bytes"]
            rows.append(
                {
                    **big,
                    "pss_x": (big["pss"] - tiny["pss"]) / m,
                    "worker_uss_x": (big["worker_uss_mean"] - tiny["worker_uss_mean"]) / m,
                    "shm_x": (big["shm"] - tiny["shm"]) / m,
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return {"mb": args.mb, "batches": args.batches, "rows": rows}


def table(report: dict) -> str:
    lines = [
        f"MLP of {report['mb']:.0f} MB, MultiSyncCollector on Pendulum, {report['batches']} publishes",
        "",
        "| workers | scheme | summed PSS | per worker (USS) | /dev/shm | runs unpublished writes |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['workers']} | {r['scheme']} | {r['pss_x']:.2f}x | {r['worker_uss_x']:.2f}x | {r['shm_x']:.2f}x "
            f"| {'yes' if r['runs_unpublished'] else 'no'} |"
        )
    lines.append("")
    lines.append("Memory in multiples of the model, net of the same run with a 4 KB model.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=list(Args.workers))
    parser.add_argument("--mb", type=float, default=Args.mb)
    parser.add_argument("--batches", type=int, default=Args.batches)
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=SCHEMES)
    parser.add_argument("--docs", action="store_true", help="write docs/results/memory_bench.md")
    parser.add_argument("--measure", nargs=4, help=argparse.SUPPRESS)  # KIND BYTES WORKERS BATCHES: one run
    ns = parser.parse_args(argv)
    if ns.measure:
        torch.set_num_threads(1)
        kind, nbytes, workers, batches = ns.measure
        print(json.dumps(measure(kind, int(nbytes), int(workers), int(batches))))
        return 0
    args = Args(tuple(ns.workers), ns.mb, ns.batches, tuple(ns.schemes), ns.docs)
    torch.set_num_threads(1)
    report = run(args)
    text = table(report)
    print(text)
    if args.docs:
        from provenance import write

        write("memory_bench", text, MEASURES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
