"""What a publish and a reload cost when part of the weights stays as it is: a frozen backbone
with a trained head, side by side with a store of the head alone and with one where everything
changes, in one run.

    python benchmarks/frozen_bench.py              # 128 MB frozen + 4 MB trained (about a minute)
    python benchmarks/frozen_bench.py --quick      # 32 MB + 1 MB
    python benchmarks/frozen_bench.py --docs       # also write docs/results/frozen_bench.md

Each case publishes a policy whose trained part an in-place step (as an optimizer's) changes
before every publish, and two readers reload it: one that copies (``zero_copy=False``) and one
that runs in place. Cases:

* ``frozen + head``: the backbone never written, the head stepped;
* ``head alone``: a store of the head only (what a publish of the changed part costs, the goal);
* ``all changed``: backbone and head stepped, every leaf changes at every publish;
* ``every leaf copied``: the same, its store copying every leaf without looking (as a publish did
  before any leaf was proved unchanged: the goal's baseline);
* ``floor``: one copy of everything into shared memory, as a publish copies (``copy_all``).

Reported: medians of publish, of each reader's reload, and of publish plus the copying reader's
reload; and as ratios (the median of each round's ratio: the cases take turns round by round),
``frozen + head`` against ``head alone`` (the goal: at most 1.5x) and ``all changed`` against
``every leaf copied`` (at most 1.05x). The proof of what stayed unchanged (written pages, or
comparison where write tracking is unavailable) is the store's own
(``store.info()["unchanged_proof"]``); ``--compare`` runs the comparison proof instead.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

from shmsync.writer.changes import SourceChanges

MB = 1 << 20


class Policy(nn.Module):
    """A backbone of ``backbone_bytes`` (absent when 0) and a head of ``head_bytes``."""

    def __init__(self, backbone_bytes: int, head_bytes: int) -> None:
        super().__init__()
        if backbone_bytes:
            self.backbone = nn.Parameter(torch.randn(backbone_bytes // 4), requires_grad=False)
        self.head = nn.Parameter(torch.randn(head_bytes // 4))


class CopyEverything(SourceChanges):
    """Finds every leaf changed without looking: the store then publishes as it did before any
    leaf was proved unchanged (the baseline of ``all changed``)."""

    def find(self, source: list[torch.Tensor], held: list[torch.Tensor] | None, moment: str) -> list[bool]:
        self._found = [True] * len(source)
        return self._found


class Case:
    """One case's store, its policy and its two readers."""

    def __init__(self, case: str, backbone: int, head: int) -> None:
        from shmsync import WeightReader, WeightStore

        self.case, size = case, 0 if case == "head alone" else backbone
        self.policy = Policy(size, head)
        self.store = WeightStore.create(self.policy)
        if case == "every leaf copied":  # a publish as it was before any leaf was proved unchanged
            self.store.writer.changes = CopyEverything(len(self.store.memory.layout.entries))
        self.copying = WeightReader(self.store, Policy(size, head), zero_copy=False)
        self.in_place = WeightReader(self.store, Policy(size, head), zero_copy=True)
        for reader in (self.copying, self.in_place):
            reader.poll()
        self.times: dict[str, list[float]] = {"publish": [], "copying reload": [], "in-place reload": []}
        self.copied: list[int] = []

    def step(self, timed: bool) -> None:
        """An in-place step on what trains, a publish, and both readers' reloads."""
        with torch.no_grad():
            self.policy.head.add_(1.0)
            if self.case in ("all changed", "every leaf copied"):
                self.policy.backbone.add_(1.0)
        start = time.perf_counter()
        self.store.publish(self.policy)
        published = time.perf_counter()
        self.copying.poll()
        copied_at = time.perf_counter()
        self.in_place.poll()
        done = time.perf_counter()
        if timed:
            self.times["publish"].append(published - start)
            self.times["copying reload"].append(copied_at - published)
            self.times["in-place reload"].append(done - copied_at)
            self.copied.append(self.store.info()["copied_bytes"])

    def close(self) -> dict[str, float]:
        """The medians, what was copied, the store's proof; the store and its readers let go."""
        out = {k: statistics.median(v) for k, v in self.times.items()}
        out["copied"] = statistics.median(self.copied)
        out["proof"] = self.store.info()["unchanged_proof"]
        self.copying.close()
        self.in_place.close()
        self.store.close()
        return out


class Floor:
    """One copy of everything as a publish copies (``copy_all``: split across the idle cores from
    4 MB on), into shared memory: what a publish of every leaf cost before any was proved
    unchanged, less a few header words."""

    def __init__(self, nbytes: int) -> None:
        self.source, self.slot = torch.randn(nbytes // 4), torch.empty(nbytes // 4).share_memory_()
        self.times: list[float] = []

    def step(self, timed: bool) -> None:
        from shmsync.store.copies import copy_all

        self.source.add_(1.0)
        start = time.perf_counter()
        copy_all([self.slot], [self.source], True)
        if timed:
            self.times.append(time.perf_counter() - start)


def measure(backbone: int, head: int, rounds: int) -> tuple[dict[str, dict[str, float]], float, dict[str, float]]:
    """Every case and the floor, taking turns round by round (so that the machine's drift hits all
    alike); the first rounds fill every slot once and start tracking what stays unchanged. Returns
    the medians, the floor's, and the two ratios the goals are about, each the median of the
    ratios of one round (a round's cases ran side by side)."""
    cases = [Case(c, backbone, head) for c in ("frozen + head", "head alone", "all changed", "every leaf copied")]
    floor = Floor(backbone + head)
    try:
        for r in range(rounds + 3):
            for one in (*cases, floor):
                one.step(timed=r >= 3)
        frozen, alone, changed, today = (c.times for c in cases)
        ratios = {
            "publish": statistics.median(a / b for a, b in zip(frozen["publish"], alone["publish"])),
            "publish + copying reload": statistics.median(
                (a + c) / (b + d)
                for a, b, c, d in zip(
                    frozen["publish"], alone["publish"], frozen["copying reload"], alone["copying reload"]
                )
            ),
            "all changed": statistics.median(a / b for a, b in zip(changed["publish"], today["publish"])),
            "all changed, floor": statistics.median(a / b for a, b in zip(changed["publish"], floor.times)),
        }
    finally:
        medians = {c.case: c.close() for c in cases}
    return medians, statistics.median(floor.times), ratios


def fmt(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 MB frozen + 1 MB trained")
    parser.add_argument("--rounds", type=int, default=40, help="publishes per case (default 40)")
    parser.add_argument("--compare", action="store_true", help="prove unchanged leaves by comparison")
    parser.add_argument("--docs", action="store_true", help="also write docs/results/frozen_bench.md")
    args = parser.parse_args(argv)
    if args.compare:
        os.environ["SHMSYNC_WRITE_TRACKING"] = "0"
    torch.set_num_threads(1)  # as TorchRL sets a trainer beside its workers on 2 cores
    backbone, head = (32 * MB, MB) if args.quick else (128 * MB, 4 * MB)
    from shmsync.core.header import PROOFS

    med, base, ratio = measure(backbone, head, args.rounds)
    total = {case: m["publish"] + m["copying reload"] for case, m in med.items()}  # the table's last column
    lines = [
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, one torch "
        f"thread; {backbone // MB} MB frozen + {head // MB} MB trained, {args.rounds} publishes per case, medians; "
        f"unchanged proved by: {PROOFS[int(med['frozen + head']['proof'])]}",
        "",
        "| case | publish | bytes copied | copying reader's reload | in-place reader's reload "
        "| publish + copying reload |",
        "|---|---|---|---|---|---|",
    ]
    for case, m in med.items():
        lines.append(
            f"| {case} | {fmt(m['publish'])} | {m['copied'] / MB:.1f} MB | {fmt(m['copying reload'])} "
            f"| {fmt(m['in-place reload'])} | {fmt(total[case])} |"
        )
    lines.append(f"| floor: one copy of everything, as a publish copies | {fmt(base)} | | | | |")
    lines += [
        "",
        f"frozen + head against head alone, round by round: publish {ratio['publish']:.2f}x, publish + copying "
        f"reload **{ratio['publish + copying reload']:.2f}x** (goal: at most 1.5x)",
        f"all changed against every leaf copied without looking, round by round: publish "
        f"**{ratio['all changed']:.2f}x** (goal: at most 1.05x); against the floor {ratio['all changed, floor']:.2f}x",
    ]
    text = "\n".join(lines)
    print(text)
    if args.docs:
        path = Path(__file__).resolve().parents[1] / "docs/results/frozen_bench.md"
        stamp = time.strftime("%Y-%m-%d")
        path.write_text(f"Written by `python benchmarks/frozen_bench.py --docs` on {stamp}, from one run.\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
