"""The readers' table: what reading it costs, what it costs publish() and poll(), and how it
compares with asking TorchRL's workers, side by side in one run.

    python benchmarks/table_bench.py           # about two minutes on 2 cores
    python benchmarks/table_bench.py --quick   # under a minute
    python benchmarks/table_bench.py --docs    # also writes docs/results/table_bench.md

1. Reading the table of a store with 8, 64 and 1,000 readers: in the trainer (its mapped header,
   ``store.readers()``), with each reader's process state looked up too, and from another
   process (``shmsync ls NAME``'s path: the header read with ``pread``).
2. ``poll()`` with nothing new and ``publish()`` of 4 KB and 1 MB, with the stale-reader alarm
   reading a 64-reader table twice a second on its thread, against the same without it, in
   alternating blocks (a drift of the machine falls on both).
3. Learning every worker's version in a 4-worker ``MultiSyncCollector`` between batches:
   ``scheme.readers()`` against TorchRL's ``collector.state_dict()`` (which asks each worker over
   its pipe and waits for the answers; TorchRL 0.14.1 has no per-worker version query of its own).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

# The code this benchmark's results measure (benchmarks/provenance.py).
MEASURES = [
    "benchmarks/table_bench.py",
    "shmsync/store/reader_table.py",
    "shmsync/watch",
    "shmsync/core/protocol.py",
    "shmsync/core/header.py",
]

warnings.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]


def per_call(fn, reps: int, warmup: int = 3) -> float:
    """The median time of one call of ``fn``, in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def fmt_us(s: float) -> str:
    return f"{s * 1e6:.2f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def hold_readers(name: str, first: int, count: int, conn) -> None:
    """A process holding ``count`` readers of store ``name`` (workers ``first`` on), loaded."""
    from shmsync import WeightReader, WeightStore

    store = WeightStore.attach(name)
    readers = [WeightReader(store, nn.Linear(8, 8), worker=first + i) for i in range(count)]
    for r in readers:
        r.poll()
    conn.send("ready")
    conn.recv()  # until told to go


def bench_reads(counts: list[int], quick: bool) -> list[dict]:
    import multiprocessing as mp

    from shmsync import WeightStore
    from shmsync.tools import host

    ctx = mp.get_context("spawn")
    rows = []
    for n in counts:
        policy = nn.Linear(8, 8)
        store = WeightStore.create(policy, name=f"table-bench-{n}")
        # Readers in processes of their own, as workers are: their rows' locks are others'.
        holders = []
        per = -(-n // 8)
        for first in range(0, n, per):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=hold_readers, args=(store.name, first, min(per, n - first), child))
            proc.start()
            holders.append((proc, parent))
        for _, conn in holders:
            assert conn.recv() == "ready"
        store.publish(policy)
        assert len(store.readers()) == n
        reps = 20 if n >= 1000 else 200
        reps = max(5, reps // 4) if quick else reps
        plain = per_call(store.readers, reps)
        states = per_call(lambda s=store: s.readers(processes=True, memory=False), max(3, reps // 10))
        outside = per_call(lambda s=store: host.table(s.name, processes=False), reps)
        rows.append(
            {
                "readers": n,
                "trainer_s": plain,
                "trainer_per_reader_s": plain / n,
                "with_state_per_reader_s": states / n,
                "other_process_per_reader_s": outside / n,
            }
        )
        for proc, conn in holders:
            conn.send("go")
            proc.join(30)
        store.close()
    return rows


def bench_alarm_cost(quick: bool) -> list[dict]:
    """poll() and publish() with the alarm thread reading a 64-reader table, and without, in
    alternating blocks."""
    from shmsync import WeightReader, WeightStore
    from shmsync.watch.alarm import ReaderAlarm

    out = []
    for label, nbytes in (("4 KB", 4 << 10), ("1 MB", 1 << 20)):
        policy = nn.Linear(nbytes // 4, 1, bias=False)
        store = WeightStore.create(policy)
        readers = [WeightReader(store, nn.Linear(nbytes // 4, 1, bias=False), worker=i) for i in range(64)]
        for r in readers:
            r.poll()
        poller = readers[0]
        alarm = ReaderAlarm(store.readers, on_stale=lambda event: None)
        blocks = 6 if quick else 20
        calls = {
            "poll": (poller.poll, 20_000),
            "publish": (lambda store=store, policy=policy: store.publish(policy), 400 if nbytes > 4096 else 4000),
        }
        for what, (fn, n) in calls.items():
            times = {"off": [], "on": []}
            for b in range(2 * blocks):
                state = "on" if b % 2 else "off"
                (alarm.start if state == "on" else alarm.stop)()
                started = time.perf_counter()  # a block long enough for the alarm to tick within it
                while time.perf_counter() - started < 0.6:
                    times[state].append(per_call(fn, max(1, n // 20), warmup=1))
            alarm.stop()
            off, on = statistics.median(times["off"]), statistics.median(times["on"])
            out.append({"payload": label, "call": what, "without_s": off, "with_alarm_s": on, "ratio": on / off})
        for r in readers:
            r.close()
        store.close()
    return out


def bench_torchrl(quick: bool) -> list[dict]:
    from torchrl.collectors import MultiSyncCollector
    from torchrl.envs import GymEnv

    from shmsync import ShmWeightSyncScheme

    def make_env():
        return GymEnv("Pendulum-v1")

    from tensordict.nn import TensorDictModule

    policy = TensorDictModule(nn.Linear(3, 1), in_keys=["observation"], out_keys=["action"])
    scheme = ShmWeightSyncScheme()
    collector = MultiSyncCollector(
        [make_env] * 4, policy, frames_per_batch=200, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    try:
        it = iter(collector)
        next(it)
        collector.update_policy_weights_()
        reps = 20 if quick else 100
        ours = per_call(scheme.readers, reps)
        theirs = per_call(collector.state_dict, reps)
        versions = sorted((r.worker, r.version) for r in scheme.readers())
        state = collector.state_dict()
        asked = sorted((w, int(state[f"worker{w}"].get("policy_version", -1) or -1)) for w in range(4))
    finally:
        collector.shutdown()
    return [
        {
            "how": "shmsync scheme.readers()",
            "seconds": ours,
            "messages": 0,
            "answer": versions,
        },
        {
            "how": "TorchRL collector.state_dict()",
            "seconds": theirs,
            "messages": 8,
            "answer": asked,
        },
    ]


def render(report: dict) -> str:
    lines = ["### Reading the readers' table", ""]
    head = "| readers | whole table, in the trainer | per reader | per reader, with process state |"
    lines += [head + " per reader, from another process |"]
    lines += ["|---|---|---|---|---|"]
    for r in report["reads"]:
        lines.append(
            f"| {r['readers']:,} | {fmt_us(r['trainer_s'])} | {fmt_us(r['trainer_per_reader_s'])} | "
            f"{fmt_us(r['with_state_per_reader_s'])} | {fmt_us(r['other_process_per_reader_s'])} |"
        )
    lines += ["", "### poll() and publish() beside the stale-reader alarm (64 readers)", ""]
    lines += ["| payload | call | without the alarm | with it | ratio |", "|---|---|---|---|---|"]
    for r in report["alarm"]:
        lines.append(
            f"| {r['payload']} | {r['call']}() | {fmt_us(r['without_s'])} | {fmt_us(r['with_alarm_s'])} | "
            f"{r['ratio']:.3f}x |"
        )
    lines += ["", "### Every worker's version, 4-worker MultiSyncCollector between batches", ""]
    lines += ["| how | time | messages to workers |", "|---|---|---|"]
    ours, theirs = report["torchrl"]
    for r in report["torchrl"]:
        lines.append(f"| {r['how']} | {fmt_us(r['seconds'])} | {r['messages']} |")
    lines += [
        "",
        f"`scheme.readers()` takes {theirs['seconds'] / ours['seconds']:.0f}x less time than asking the workers.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--docs", action="store_true", help="write docs/results/table_bench.md")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    report = {
        "reads": bench_reads([8, 64, 1000], args.quick),
        "alarm": bench_alarm_cost(args.quick),
        "torchrl": bench_torchrl(args.quick),
    }
    text = render(report)
    print(text)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    if args.docs:
        from provenance import write

        write("table_bench", text, MEASURES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
