"""Soak: a writer publishing flat out beside a plain reader, one in place and a pinned one, every
accepted copy checked element by element.

    python benchmarks/soak.py                                # 30 s per store size
    python benchmarks/soak.py --seconds 900 --sizes 4KB      # a long soak of the small store
    python benchmarks/soak.py --sizes 4KB,16MB --min-reloads 100000000,0 --docs docs/results/soak.md

Each version fills every element of the store with its number (int64, exact at any count). Each
reader reloads as fast as it can (a forced reload, so that every iteration is a validated copy
racing the writer, not only those after a publish) and counts a copy as torn if its elements
are not all one version, or not the version the reader reports. The three readers:

* plain: optimistic copies, the pin when they keep failing (what a worker does);
* zero-copy: leases the latest slot and reads it in place (``zero_copy=True``); each check runs
  while the lease holds, so a write into a leased slot shows as torn;
* pinned: every read asks the writer to pin a slot first (the path a reader slower than the
  writer takes), so the pin's hand-over is exercised on every reload.

Torn must be 0. The writer and the readers share the machine's cores: rates are for this
machine, and show where the time goes, not a limit of the protocol.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

# The code this benchmark's results measure (benchmarks/provenance.py).
MEASURES = ["benchmarks/soak.py", "shmsync/writer", "shmsync/reader", "shmsync/store", "shmsync/core"]

SIZES = {"4KB": 4 << 10, "1MB": 1 << 20, "16MB": 16 << 20}
KINDS = ("plain", "zero-copy", "pinned")


@dataclass
class Args:
    seconds: float = 30.0  # per store size, at least
    min_reloads: str = "0"  # per store size (one number, or one per size): go on until this many accepted
    sizes: str = "4KB,16MB"
    docs: str = ""  # write the table to this markdown file too


class Weights(nn.Module):
    """``nbytes`` of int64 weights (a parameter: what a reader in place views)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(nbytes // 8, dtype=torch.int64), requires_grad=False)


def read_loop(kind: str, name: str, conn) -> None:
    """One reader: reload, check, until told to stop; then report its counts."""
    from shmsync import WeightReader, WeightStore
    from shmsync.core.protocol import SlotReader

    torch.set_num_threads(1)
    if kind == "pinned":
        SlotReader.outpaced = lambda self: True  # this reader's copies take the pinned path, every one
    store = WeightStore.attach(name)
    target = Weights(store.nbytes)
    reader = WeightReader(store, target, zero_copy=kind == "zero-copy")
    reloads = torn = viewed = 0
    conn.send("ready")
    while not conn.poll():
        for _ in range(200):
            reader.reload()
            lo, hi = torch.aminmax(target.w)
            if lo != hi or lo != reader.version:
                torn += 1
            reloads += 1
            viewed += reader.viewing
    conn.recv()
    conn.send(
        {
            "kind": kind,
            "reloads": reloads,
            "torn": torn,
            "viewed": viewed,
            "failed_copies": store.slot_reader.retries,
            "pinned_reads": store.slot_reader.pinned_reads,
        }
    )
    reader.close()
    store.close()


def soak(label: str, nbytes: int, seconds: float, min_reloads: int) -> dict:
    from shmsync import WeightStore

    ctx = mp.get_context("spawn")
    source = Weights(nbytes)
    store = WeightStore.create(source)
    readers = []
    try:
        for kind in KINDS:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=read_loop, args=(kind, store.name, child), daemon=True)
            proc.start()
            readers.append((proc, parent))
        for _, conn in readers:
            if not conn.poll(120) or conn.recv() != "ready":
                raise RuntimeError("a reader did not start")
        publishes = 0
        began = last_check = time.monotonic()
        while True:
            source.w.fill_(publishes + 1)
            store.publish(source)
            publishes += 1
            now = time.monotonic()
            if now - began < seconds:
                continue
            if not min_reloads:
                break
            if now - last_check > 5:  # the reader table's counters, read every few seconds only
                last_check = now
                if _peek(store) >= min_reloads:
                    break
        elapsed = time.monotonic() - began
        for _, conn in readers:
            conn.send("stop")
        results = []
        for _, conn in readers:
            if not conn.poll(120):
                raise RuntimeError("a reader did not report")
            results.append(conn.recv())
    finally:
        for proc, _ in readers:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        store.close()
    total = sum(r["reloads"] for r in results)
    return {
        "store": label,
        "seconds": elapsed,
        "publishes": publishes,
        "reloads": total,
        "torn": sum(r["torn"] for r in results),
        "per_reader": results,
    }


def _peek(store) -> int:
    """The reloads the readers recorded in the reader table so far (their rows' counters)."""
    return sum(row.reloads for row in store.readers())


def report(runs: list[dict]) -> str:
    lines = [
        f"# shmsync soak: {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}",
        "",
        "store  seconds  publishes    accepted reloads  torn  reloads/s  "
        "per reader (reloads, torn, failed copies, pinned reads)",
        "-----  -------  -----------  ----------------  ----  ---------  "
        "------------------------------------------------------",
    ]
    for run in runs:
        per = "; ".join(
            f"{r['kind']} {r['reloads']:,}, {r['torn']}, {r['failed_copies']:,}, {r['pinned_reads']:,}"
            for r in run["per_reader"]
        )
        lines.append(
            f"{run['store']:<5}  {run['seconds']:>7.0f}  {run['publishes']:>11,}  {run['reloads']:>16,}"
            f"  {run['torn']:>4}  {run['reloads'] / run['seconds']:>9,.0f}  {per}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    for name, default in vars(Args()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default)
    args = Args(**vars(parser.parse_args(argv)))
    labels = args.sizes.split(",")
    targets = [int(n) for n in args.min_reloads.split(",")]
    if len(targets) == 1:
        targets *= len(labels)
    if len(targets) != len(labels) or min(targets) < 0:
        parser.error("--min-reloads: one count, or one per size")
    runs = []
    for label, target in zip(labels, targets):
        if label not in SIZES:
            parser.error(f"--sizes: {label!r} is not one of {', '.join(SIZES)}")
        runs.append(soak(label, SIZES[label], args.seconds, target))
        print(f"  {label}: {runs[-1]['reloads']:,} reloads, {runs[-1]['torn']} torn", file=sys.stderr, flush=True)
    text = report(runs)
    print(text)
    if args.docs:
        from provenance import write

        write(Path(args.docs).stem, f"```text\n{text}\n```", MEASURES)
    return 1 if any(run["torn"] for run in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
