"""The training loop per batch, where users feel weight sync: one update, then the next batch.

    python benchmarks/loop_bench.py                  # 1, 16, 128 MB x 2, 4 workers (about 10 minutes on 2 cores)
    python benchmarks/loop_bench.py --quick          # 1 and 16 MB, 2 workers, fewer batches
    python benchmarks/loop_bench.py --docs           # also write docs/results/loop_bench.md

For each payload and worker count, three ``MultiSyncCollector`` s run side by side in one process,
each on Pendulum with a policy that carries the payload:

* ``shmsync``: ``ShmWeightSyncScheme()`` with its defaults;
* ``SharedMem``: TorchRL's ``SharedMemWeightSyncScheme()``;
* ``floor``: no weight sync at all (TorchRL's ``NoWeightSyncScheme``) and one plain ``copy_`` of the
  weights into a shared-memory buffer: the least any scheme that copies once can cost.

Each loop, as a trainer's: write the weights (an optimizer step: not timed), ``update_policy_weights_()``,
then take the next batch. The three collectors take turns batch by batch, so the machine's drift hits
all alike. Reported: the median loop per batch and TorchRL's over shmsync's (above 1: shmsync is
faster), the median update call, and each against the floor.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

warnings.filterwarnings("ignore")
os.environ.setdefault("RL_WARNINGS", "False")

MB = 1 << 20
KINDS = ("shmsync", "SharedMem", "floor")


class PayloadPolicy(nn.Module):
    """A Pendulum policy carrying a payload of the requested size. Each call reads one number from
    every 4 KB page of it, as a real policy reads all its weights (so every page is mapped in the
    worker), at a fraction of a real forward's cost."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.head = nn.Linear(3, 1)
        self.payload = nn.Parameter(torch.zeros(max(1, nbytes // 4 - 4)))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return 2 * torch.tanh(self.head(observation) + 1e-6 * self.payload[::1024].sum())


def make_policy(nbytes: int) -> TensorDictModule:
    return TensorDictModule(PayloadPolicy(nbytes), in_keys=["observation"], out_keys=["action"])


def make_env():
    from torchrl.envs import GymEnv

    return GymEnv("Pendulum-v1")


def build(kind: str, nbytes: int, workers: int, frames: int, explicit: bool):
    """A collector of ``kind``, the trainer's module it writes, and the update call of its loop.
    ``explicit``: the trainer writes a module of its own and passes its weights to each update (a
    loss module's copy); else it writes the collector's policy and updates with no argument."""
    from torchrl.collectors import MultiSyncCollector
    from torchrl.weight_update import NoWeightSyncScheme, SharedMemWeightSyncScheme

    from shmsync import ShmWeightSyncScheme

    policy = make_policy(nbytes)
    scheme = {"shmsync": ShmWeightSyncScheme, "SharedMem": SharedMemWeightSyncScheme, "floor": NoWeightSyncScheme}[
        kind
    ]()
    # The floor's workers build their own policy: nothing is sent to them, ever.
    given = {"policy_factory": functools.partial(make_policy, nbytes)} if kind == "floor" else {"policy": policy}
    collector = MultiSyncCollector(
        [make_env] * workers, frames_per_batch=frames, total_frames=-1, weight_sync_schemes={"policy": scheme}, **given
    )
    trainer = make_policy(nbytes) if explicit else policy
    if kind == "floor":
        params = [p.detach() for p in trainer.parameters()]
        shared = [torch.empty_like(p).share_memory_() for p in params]

        def update() -> None:
            torch._foreach_copy_(shared, params)
    elif explicit:
        weights = TensorDict.from_module(trainer)
        update = functools.partial(collector.update_policy_weights_, weights)
    else:
        update = collector.update_policy_weights_
    return collector, trainer, update


def measure(nbytes: int, workers: int, batches: int, frames: int, explicit: bool) -> dict:
    """Loops per batch and update calls of each kind, taking turns batch by batch."""
    runs = {kind: build(kind, nbytes, workers, frames, explicit) for kind in KINDS}
    loops: dict[str, list[float]] = {k: [] for k in KINDS}
    updates: dict[str, list[float]] = {k: [] for k in KINDS}
    try:
        iters = {k: iter(run[0]) for k, run in runs.items()}
        for _ in range(3):  # workers started, first weights loaded, caches warm
            for k, (_, _, update) in runs.items():
                update()
                next(iters[k])
        for b in range(batches):
            for k, (_, policy, update) in runs.items():
                with torch.no_grad():  # the optimizer step of this loop
                    for p in policy.parameters():
                        p.fill_(float(b))
                start = time.perf_counter()
                update()
                returned = time.perf_counter()
                next(iters[k])
                loops[k].append(time.perf_counter() - start)
                updates[k].append(returned - start)
    finally:
        for collector, _, _ in runs.values():
            collector.shutdown()
        del runs
        gc.collect()
    return {"bytes": nbytes, "workers": workers, "explicit": explicit, "loops": loops, "updates": updates}


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def fmt_t(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def render(results: list[dict], machine: dict) -> str:
    first = results[0]
    lines = [
        f"{machine['cpu']}, {machine['cores']} cores, torch {machine['torch']}, torchrl {machine['torchrl']}; "
        f"MultiSyncCollector on Pendulum, {first['frames']} frames per batch, {first['batches']} batches per "
        "scheme and case, medians; SharedMem / shmsync above 1: shmsync is faster",
    ]
    for explicit, title in (
        (True, "The trainer's own module, its weights passed: update_policy_weights_(weights)"),
        (False, "The collector's policy, written in place: update_policy_weights_()"),
    ):
        rows = [r for r in results if r["explicit"] == explicit]
        if not rows:
            continue
        head = (
            "| payload | workers | loop per batch: shmsync | SharedMem | floor | SharedMem / shmsync "
            "| shmsync / floor | update call: shmsync | SharedMem | SharedMem / shmsync |"
        )
        lines += ["", title, "", head, "|" + "---|" * (head.count("|") - 1)]
        for r in rows:
            loop = {k: median(v) for k, v in r["loops"].items()}
            upd = {k: median(v) for k, v in r["updates"].items()}
            lines.append(
                f"| {r['bytes'] // MB} MB | {r['workers']} | {fmt_t(loop['shmsync'])} | {fmt_t(loop['SharedMem'])} "
                f"| {fmt_t(loop['floor'])} | **{loop['SharedMem'] / loop['shmsync']:.2f}x** "
                f"| {loop['shmsync'] / loop['floor']:.2f}x | {fmt_t(upd['shmsync'])} | {fmt_t(upd['SharedMem'])} "
                f"| {upd['SharedMem'] / upd['shmsync']:.1f}x |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 and 16 MB, 2 workers, 30 batches")
    parser.add_argument("--batches", type=int, default=None, help="batches per scheme and case (default 60)")
    parser.add_argument("--frames", type=int, default=32, help="frames per batch (default 32)")
    parser.add_argument("--sizes", default=None, help="payloads in MB, comma-separated (default 1,16,128)")
    parser.add_argument("--workers", default=None, help="worker counts, comma-separated (default 2,4)")
    parser.add_argument(
        "--cases", default="explicit,policy", help="explicit (weights passed), policy (no argument), or both"
    )
    parser.add_argument("--docs", action="store_true", help="also write docs/results/loop_bench.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as TorchRL sets the trainer on 2 cores
    sizes = [int(s) for s in (args.sizes or ("1,16" if args.quick else "1,16,128")).split(",")]
    workers = [int(w) for w in (args.workers or ("2" if args.quick else "2,4")).split(",")]
    cases = [c == "explicit" for c in args.cases.split(",")]
    batches = args.batches or (30 if args.quick else 60)
    import torchrl

    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torchrl": torchrl.__version__,
    }
    results = []
    for explicit in cases:
        for w in workers:
            for mb in sizes:
                r = measure(mb * MB, w, batches, args.frames, explicit)
                r.update(frames=args.frames, batches=batches)
                results.append(r)
                loop = {k: median(v) for k, v in r["loops"].items()}
                case = "weights passed" if explicit else "no argument"
                print(
                    f"  {case}, {mb} MB, {w} workers: " + ", ".join(f"{k} {fmt_t(v)}" for k, v in loop.items()),
                    file=sys.stderr,
                )
    text = render(results, machine)
    print(text)
    if args.docs:
        path = Path(__file__).resolve().parents[1] / "docs/results/loop_bench.md"
        stamp = time.strftime("%Y-%m-%d")
        path.write_text(f"Written by `python benchmarks/loop_bench.py --docs` on {stamp}, from one run.\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
