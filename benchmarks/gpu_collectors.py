"""shmsync against TorchRL's SharedMemWeightSyncScheme with policies on a GPU, side by side in one run.

    python benchmarks/gpu_collectors.py                 # on a GPU machine (benchmarks/gpu_check.sh runs it)
    python benchmarks/gpu_collectors.py --device cpu --sizes 1MB --seconds 2   # a dry run anywhere

1. ``MultiSyncCollector``, policy and workers on the device, Pendulum on the CPU: per payload and
   number of workers, the trainer's ``update_policy_weights_()`` call, the loop's time per batch, and
   the share of batches right after an update that ran the new version, the trainer never
   synchronizing (it fills its weights on its stream, then updates).
2. ``MultiAsyncCollector``, 2 workers, the trainer publishing flat out from a thread while the
   loop collects: torn frames (a policy call that saw two versions: its weights' min and max
   differ), frames per second and updates per second.
3. One big policy (``--big``, bf16) from ``publish()`` to a reader process's GPU: through the
   device slots (in place) and through the host slots; and to a CPU reader, in place.

Times are medians; the JSON goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
from torch import nn

warnings.filterwarnings("ignore")
os.environ.setdefault("RL_WARNINGS", "False")

SIZES = {"1MB": 1 << 20, "64MB": 64 << 20, "512MB": 512 << 20, "256MB": 256 << 20}


class Payload(nn.Module):
    """A Pendulum policy carrying ``nbytes`` of weights; each call reports the lowest and the highest
    of them (``full``: over all of them, which shows a mix of two versions; else the first and last)."""

    def __init__(self, nbytes: int, full: bool = False) -> None:
        super().__init__()
        self.full = full
        self.w = nn.Parameter(torch.zeros(max(2, nbytes // 4)))
        self.head = nn.Linear(3, 1)

    def forward(self, observation: torch.Tensor):
        with torch.no_grad():
            w = self.w
            lo, hi = (w.min(), w.max()) if self.full else (w[0], w[-1])
        batch = observation.shape[:-1]
        return 2 * torch.tanh(self.head(observation)), lo.expand(batch).clone(), hi.expand(batch).clone()


def make_env():
    from torchrl.envs import GymEnv

    return GymEnv("Pendulum-v1")


def make_policy(nbytes: int, device: str, full: bool = False):
    from tensordict.nn import TensorDictModule

    return TensorDictModule(Payload(nbytes, full), in_keys=["observation"], out_keys=["action", "lo", "hi"]).to(device)


def make_scheme(kind: str):
    if kind == "shmsync":
        from shmsync import ShmWeightSyncScheme

        return ShmWeightSyncScheme()
    from torchrl.weight_update import SharedMemWeightSyncScheme

    return SharedMemWeightSyncScheme()


def collector(cls_name: str, kind: str, policy, workers: int, device: str, fpb: int):
    import torchrl.collectors as collectors

    return getattr(collectors, cls_name)(
        [make_env] * workers,
        policy,
        frames_per_batch=fpb,
        total_frames=-1,
        policy_device=device,
        env_device="cpu",
        storing_device="cpu",
        weight_sync_schemes={"policy": make_scheme(kind)},
    )


def fill(policy, value: float) -> None:
    with torch.no_grad():
        for p in policy.parameters():
            p.fill_(value)  # on the trainer's stream: no synchronize


def bench_sync(kind: str, nbytes: int, workers: int, device: str, batches: int) -> dict:
    policy = make_policy(nbytes, device)
    c = collector("MultiSyncCollector", kind, policy, workers, device, fpb=16 * workers)
    updates, loops, exact = [], [], []
    try:
        it = iter(c)
        next(it)
        last = time.perf_counter()
        for version in range(1, batches + 4):
            fill(policy, float(version))
            t = time.perf_counter()
            c.update_policy_weights_()
            took = time.perf_counter() - t
            batch = next(it)
            now = time.perf_counter()
            if version > 3:  # warm: every slot and buffer written once
                updates.append(took)
                loops.append(now - last)
                exact.append(bool((batch["lo"] == version).all() and (batch["hi"] == version).all()))
            last = now
    finally:
        c.shutdown()
    return {
        "scheme": kind,
        "bytes": nbytes,
        "workers": workers,
        "update_ms": statistics.median(updates) * 1e3,
        "loop_ms": statistics.median(loops) * 1e3,
        "next_batch_new": sum(exact) / len(exact),
    }


def bench_async(kind: str, nbytes: int, device: str, seconds: float) -> dict:
    policy = make_policy(nbytes, device, full=True)
    c = collector("MultiAsyncCollector", kind, policy, 2, device, fpb=32)
    stop = threading.Event()
    published = [0]
    frames = torn = 0

    def publish() -> None:
        version = 1
        while not stop.is_set():
            fill(policy, float(version))
            c.update_policy_weights_()
            published[0] += 1
            version += 1

    try:
        it = iter(c)
        next(it)
        publisher = threading.Thread(target=publish, daemon=True)
        started = time.perf_counter()
        publisher.start()
        while time.perf_counter() - started < seconds:
            batch = next(it)
            frames += batch.numel()
            torn += int((batch["lo"] != batch["hi"]).sum())
        stop.set()
        publisher.join(60)
        elapsed = time.perf_counter() - started
    finally:
        stop.set()
        c.shutdown()
    return {
        "scheme": kind,
        "bytes": nbytes,
        "seconds": elapsed,
        "frames": frames,
        "torn": torn,
        "frames_per_s": frames / elapsed,
        "updates_per_s": published[0] / elapsed,
    }


# -- one big policy, end to end ----------------------------------------------------------------------
class Big(nn.Module):
    def __init__(self, numel: int, device: str) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(numel, dtype=torch.bfloat16, device=device))


def _big_reader(name: str, numel: int, device: str, options: dict, versions: int, conn) -> None:
    from shmsync import WeightReader, WeightStore

    store = WeightStore.attach(name)
    module = Big(numel, device)
    t = time.perf_counter()
    reader = WeightReader(store, module, **options)
    reader.poll()
    conn.send(("ready", time.perf_counter() - t))
    for _ in range(versions):
        want = conn.recv()
        reader.wait(want, timeout=120)
        if module.w.is_cuda:
            torch.cuda.synchronize()
        conn.send(("loaded", time.time(), float(module.w[-1])))
    reader.close()
    store.close()


def bench_big(numel: int, device: str, versions: int) -> list[dict]:
    from shmsync import WeightStore

    ctx = mp.get_context("spawn")
    trainer = Big(numel, device)
    t = time.perf_counter()
    store = WeightStore.create(trainer, num_slots=3)
    created = time.perf_counter() - t
    results = []
    cases = [("device slots, in place", device, {}), ("host slots, to the GPU", device, {"device_slots": False})]
    cases.append(("host slots, CPU reader in place", "cpu", {}))
    try:
        for label, where, options in cases:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_big_reader, args=(store.name, numel, where, options, versions, child))
            proc.start()
            _tag, attach_s = parent.recv()
            times = []
            for _version in range(1, versions + 1):
                v = store.version + 1
                fill(trainer, float(v % 200))
                if trainer.w.is_cuda:
                    torch.cuda.synchronize()  # the fill is the trainer's work, not the publish's
                parent.send(v)
                t0 = time.time()
                store.publish(trainer)
                _tag, t1, last = parent.recv()
                assert last == float(v % 200), f"{label}: loaded {last}, published {v % 200}"
                times.append(t1 - t0)
            proc.join(60)
            results.append(
                {
                    "path": label,
                    "bytes": numel * 2,
                    "publish_to_usable_s": statistics.median(times[1:] or times),
                    "attach_s": attach_s,
                    "create_s": created,
                }
            )
            print(f"  {results[-1]}", file=sys.stderr, flush=True)
    finally:
        store.close()
    return results


def table(title: str, head: list[str], rows: list[list[str]]) -> str:
    lines = [f"\n{title}", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def render(report: dict) -> str:
    m = report["machine"]
    parts = [
        f"# shmsync and TorchRL's SharedMemWeightSyncScheme on {m['device']} ({m['torch']}, torchrl {m['torchrl']})"
    ]
    by = {}
    for r in report["sync"]:
        by.setdefault((r["bytes"], r["workers"]), {})[r["scheme"]] = r
    rows = []
    for (nbytes, workers), pair in sorted(by.items()):
        s, t = pair.get("shmsync"), pair.get("SharedMem")
        if s is None or t is None:
            continue
        rows.append(
            [
                f"{nbytes >> 20} MB, {workers}",
                f"{s['update_ms']:.2f} / {t['update_ms']:.2f} ms",
                f"{s['loop_ms']:.1f} / {t['loop_ms']:.1f} ms ({s['loop_ms'] / t['loop_ms']:.2f}x)",
                f"{s['next_batch_new']:.0%} / {t['next_batch_new']:.0%}",
            ]
        )
    parts.append(
        table(
            "MultiSyncCollector, policy and workers on the GPU: shmsync / TorchRL SharedMem (medians)",
            ["payload, workers", "update_policy_weights_()", "loop per batch", "next batch on the new version"],
            rows,
        )
    )
    rows = [
        [
            r["scheme"],
            f"{r['bytes'] >> 20} MB",
            f"{r['torn']} of {r['frames']}",
            f"{r['frames_per_s']:.0f}",
            f"{r['updates_per_s']:.0f}",
        ]
        for r in report["async"]
    ]
    parts.append(
        table(
            "MultiAsyncCollector, 2 workers on the GPU, the trainer publishing flat out",
            ["scheme", "payload", "torn frames", "frames/s", "updates/s"],
            rows,
        )
    )
    rows = [
        [r["path"], f"{r['bytes'] / 1e9:.1f} GB", f"{r['publish_to_usable_s'] * 1e3:.1f} ms", f"{r['attach_s']:.2f} s"]
        for r in report.get("big", [])
    ]
    if rows:
        parts.append(
            table(
                "One big bf16 policy, from publish() to the weights usable in a reader process",
                ["path", "payload", "publish to usable", "attaching the reader"],
                rows,
            )
        )
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--sizes", nargs="*", default=["64MB", "512MB"])
    parser.add_argument("--workers", nargs="*", type=int, default=[2, 4])
    parser.add_argument("--batches", type=int, default=15)
    parser.add_argument("--async-size", default="256MB")
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--big", type=float, default=14.0, help="GB of the big bf16 policy (0: skip)")
    parser.add_argument("--out", default="benchmarks/results/gpu_collectors.json")
    args = parser.parse_args()
    import torchrl

    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    report: dict = {"machine": {"device": name, "torch": torch.__version__, "torchrl": torchrl.__version__}}
    report["sync"] = []
    for size in args.sizes:
        for workers in args.workers:
            for kind in ("shmsync", "SharedMem"):
                r = bench_sync(kind, SIZES[size], workers, args.device, args.batches)
                report["sync"].append(r)
                print(f"  sync {r}", file=sys.stderr, flush=True)
    report["async"] = []
    for kind in ("shmsync", "SharedMem"):
        r = bench_async(kind, SIZES[args.async_size], args.device, args.seconds)
        report["async"].append(r)
        print(f"  async {r}", file=sys.stderr, flush=True)
    if args.big > 0:
        report["big"] = bench_big(int(args.big * 1e9) // 2, args.device, 4)
    text = render(report)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
