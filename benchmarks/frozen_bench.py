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
* ``floor``: one plain ``copy_`` of everything into a buffer of the same size (what a publish that
  copies every leaf costs at the least: today's publish of ``all changed`` before shmsync found
  what changed cost this plus a few words).

Reported: medians of publish, of each reader's reload, and of publish plus the copying reader's
reload, and each as a ratio: ``frozen + head`` against ``head alone`` (the acceptance: at most
1.5x), ``all changed`` against ``floor`` (at most 1.05x). The proof of what stayed unchanged
(written pages, or comparison where write tracking is unavailable) is the store's own
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

MB = 1 << 20


class Policy(nn.Module):
    """A backbone of ``backbone_bytes`` (absent when 0) and a head of ``head_bytes``."""

    def __init__(self, backbone_bytes: int, head_bytes: int) -> None:
        super().__init__()
        if backbone_bytes:
            self.backbone = nn.Parameter(torch.randn(backbone_bytes // 4), requires_grad=False)
        self.head = nn.Parameter(torch.randn(head_bytes // 4))


def measure(case: str, backbone: int, head: int, rounds: int) -> dict[str, list[float]]:
    from shmsync import WeightReader, WeightStore

    policy = Policy(0 if case == "head alone" else backbone, head)
    times: dict[str, list[float]] = {"publish": [], "copying reload": [], "in-place reload": []}
    copied: list[int] = []
    with WeightStore.create(policy) as store:
        copying = WeightReader(store, Policy(0 if case == "head alone" else backbone, head), zero_copy=False)
        in_place = WeightReader(store, Policy(0 if case == "head alone" else backbone, head), zero_copy=True)
        for reader in (copying, in_place):
            reader.poll()
        for r in range(rounds + 3):
            with torch.no_grad():
                policy.head.add_(1.0)
                if case == "all changed":
                    policy.backbone.add_(1.0)
            start = time.perf_counter()
            store.publish(policy)
            published = time.perf_counter()
            copying.poll()
            copied_at = time.perf_counter()
            in_place.poll()
            done = time.perf_counter()
            if r >= 3:  # the first publishes: every slot filled once, what stays unchanged tracked
                times["publish"].append(published - start)
                times["copying reload"].append(copied_at - published)
                times["in-place reload"].append(done - copied_at)
                copied.append(store.info()["copied_bytes"])
        proof = store.info()["unchanged_proof"]
        copying.close()
        in_place.close()
    return {**times, "copied": [float(statistics.median(copied))], "proof": [float(proof)]}


def floor(nbytes: int, rounds: int) -> list[float]:
    source, slot = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    out = []
    for _ in range(rounds):
        source.add_(1.0)
        start = time.perf_counter()
        slot.copy_(source)
        out.append(time.perf_counter() - start)
    return out


def fmt(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 MB frozen + 1 MB trained")
    parser.add_argument("--rounds", type=int, default=30, help="publishes per case (default 30)")
    parser.add_argument("--compare", action="store_true", help="prove unchanged leaves by comparison")
    parser.add_argument("--docs", action="store_true", help="also write docs/results/frozen_bench.md")
    args = parser.parse_args(argv)
    if args.compare:
        os.environ["SHMSYNC_WRITE_TRACKING"] = "0"
    torch.set_num_threads(1)  # as TorchRL sets a trainer beside its workers on 2 cores
    backbone, head = (32 * MB, MB) if args.quick else (128 * MB, 4 * MB)
    from shmsync.core.header import PROOFS

    cases = {c: measure(c, backbone, head, args.rounds) for c in ("frozen + head", "head alone", "all changed")}
    base = floor(backbone + head, args.rounds)
    med = {case: {k: statistics.median(v) for k, v in r.items()} for case, r in cases.items()}
    total = {case: m["publish"] + m["copying reload"] for case, m in med.items()}
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
    lines.append(f"| floor: one copy of everything | {fmt(statistics.median(base))} | | | | |")
    lines += [
        "",
        "frozen + head against head alone: publish "
        f"{med['frozen + head']['publish'] / med['head alone']['publish']:.2f}x, "
        f"publish + copying reload **{total['frozen + head'] / total['head alone']:.2f}x** (goal: at most 1.5x)",
        f"all changed against the floor: publish **{med['all changed']['publish'] / statistics.median(base):.2f}x** "
        "(goal: at most 1.05x)",
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
