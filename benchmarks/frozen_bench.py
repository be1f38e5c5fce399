"""What a publish and a reload cost when most of the weights stay as they are, side by side with a
store of what trains alone, in one run: a publish should cost what changed.

    python benchmarks/frozen_bench.py              # 128 MB frozen + 4 MB head; a 100 MB adapted model (a minute or two)
    python benchmarks/frozen_bench.py --quick      # 32 MB + 1 MB; a 25 MB adapted model
    python benchmarks/frozen_bench.py --docs       # also write docs/results/frozen_bench.md

Each case publishes its policy after an in-place step (as an optimizer's) on what trains, and two
readers reload it: one that copies (``zero_copy=False``) and one that runs in place. Cases:

* ``frozen + head``: a backbone never written (one large tensor), a head stepped;
* ``head alone``: a store of the head only (what a publish of the changed part costs: the goal);
* ``adapted``: a model of many small modules (blocks of linear layers, each with a low-rank
  adapter, a norm and an MLP), about 1% of its bytes in the adapters, the only tensors stepped;
* ``adapters alone``: a store of those adapters only (the goal for ``adapted``);
* ``same bytes again``: the frozen + head policy rewritten whole with the bytes it holds
  (``load_state_dict`` of its own state, as a reload of an unchanged checkpoint would): nothing
  changed, so nothing should be copied;
* ``all changed``: backbone and head stepped, every leaf changes at every publish;
* ``every leaf copied``: the same, its store copying every leaf without looking (the baseline of
  ``all changed``);
* ``floor``: one copy of everything into shared memory, as a publish copies (``copy_all``).

The cases take turns round by round, each round in another order, so that the machine's drift and
the caches hit all alike. Reported: medians of publish, of each reader's reload, and of publish
plus the copying reader's reload; and as ratios, the median of each round's ratio of publish plus
copying reload: ``frozen + head`` against ``head alone`` (the goal: at most 1.3x), ``adapted``
against ``adapters alone`` (at most 1.5x), ``all changed`` against ``every leaf copied`` (at most
1.05x). The proof of what stayed unchanged is the store's own (``store.info()["unchanged_proof"]``);
``--compare`` runs the comparison proof instead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

from shmsync.writer.changes import SourceChanges

MB = 1 << 20
MEASURES = [
    "benchmarks/frozen_bench.py",
    "shmsync/writer",
    "shmsync/reader",
    "shmsync/store",
    "shmsync/core",
]


class Policy(nn.Module):
    """A backbone of ``backbone_bytes`` (absent when 0) and a head of ``head_bytes``."""

    def __init__(self, backbone_bytes: int, head_bytes: int) -> None:
        super().__init__()
        if backbone_bytes:
            self.backbone = nn.Parameter(torch.randn(backbone_bytes // 4))
        self.head = nn.Parameter(torch.randn(head_bytes // 4))

    def trained(self) -> list[torch.Tensor]:
        return [self.head]


class Adapted(nn.Linear):
    """A linear layer left as it is, with a low-rank adapter that trains beside it."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__(width, width)
        self.adapter_a = nn.Parameter(torch.randn(rank, width) / width)
        self.adapter_b = nn.Parameter(torch.zeros(width, rank))

    def adapters(self) -> list[nn.Parameter]:
        return [self.adapter_a, self.adapter_b]


class Block(nn.Sequential):
    """An attention block's shape: four adapted layers (query, key, value, out), a norm and an MLP."""

    def __init__(self, width: int, rank: int) -> None:
        mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
        super().__init__(*(Adapted(width, rank) for _ in range(4)), nn.LayerNorm(width), mlp)


class AdaptedModel(nn.Module):
    """Blocks of adapted layers: hundreds of modules and tensors, about 1% of the bytes adapters."""

    def __init__(self, blocks: int, width: int = 512, rank: int = 4) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width, rank) for _ in range(blocks)))

    def trained(self) -> list[torch.Tensor]:
        return [p for m in self.modules() if isinstance(m, Adapted) for p in m.adapters()]


class Adapters(nn.Module):
    """The adapters of an :class:`AdaptedModel` alone, as their own module."""

    def __init__(self, model: AdaptedModel) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(t.detach().clone()) for t in model.trained()])

    def trained(self) -> list[torch.Tensor]:
        return list(self.weights)


class CopyEverything(SourceChanges):
    """Finds every leaf changed without looking: the store then publishes as it did before any
    leaf was proved unchanged (the baseline of ``all changed``)."""

    def find(self, source: list[torch.Tensor], held: list[torch.Tensor] | None, moment: str) -> list[bool]:
        return [True] * len(source)


class Case:
    """One case's store, its policy and its two readers."""

    def __init__(self, case: str, make) -> None:
        from shmsync import WeightReader, WeightStore

        self.case = case
        self.policy = make()
        self.store = WeightStore.create(self.policy)
        if case == "every leaf copied":  # a publish as it was before any leaf was proved unchanged
            self.store.writer.copy.changes = CopyEverything(len(self.store.memory.layout.owners))
        self.copying = WeightReader(self.store, make(), zero_copy=False)
        self.in_place = WeightReader(self.store, make(), zero_copy=True)
        for reader in (self.copying, self.in_place):
            reader.poll()
        self.trained = [] if case == "same bytes again" else self.policy.trained()
        # What a reload of an unchanged checkpoint writes: every byte again, the same bytes.
        self.saved = {k: v.clone() for k, v in self.policy.state_dict().items()} if case == "same bytes again" else {}
        if case in ("all changed", "every leaf copied"):
            self.trained = list(self.policy.parameters())
        self.times: dict[str, list[float]] = {"publish": [], "copying reload": [], "in-place reload": []}
        self.copied: list[int] = []

    def step(self, timed: bool) -> None:
        """An in-place step on what trains (or a rewrite with the same bytes), a publish, and both
        readers' reloads."""
        with torch.no_grad():
            for t in self.trained:
                t.add_(1.0)
        if self.saved:
            self.policy.load_state_dict(self.saved)
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

    def total(self) -> list[float]:
        """Each round's publish plus copying reload."""
        return [a + b for a, b in zip(self.times["publish"], self.times["copying reload"])]

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
    4 MB on), into shared memory: what a publish of every leaf costs, less a few header words."""

    def __init__(self, nbytes: int) -> None:
        self.case = "floor"
        self.source, self.slot = torch.randn(nbytes // 4), torch.empty(nbytes // 4).share_memory_()
        self.times: dict[str, list[float]] = {"publish": []}

    def step(self, timed: bool) -> None:
        from shmsync.store.copies import copy_all

        self.source.add_(1.0)
        start = time.perf_counter()
        copy_all([self.slot], [self.source], True)
        if timed:
            self.times["publish"].append(time.perf_counter() - start)


def measure(backbone: int, head: int, blocks: int, rounds: int) -> tuple[dict, dict[str, float], float]:
    """Every case and the floor, in a new order each round (the first rounds fill every slot once
    and start tracking what stays unchanged). Returns the medians per case, the ratios the goals
    are about (each the median of one round's ratios), and the floor's median."""
    adapted = AdaptedModel(blocks)
    makers = {
        "frozen + head": lambda: Policy(backbone, head),
        "head alone": lambda: Policy(0, head),
        "adapted": lambda: AdaptedModel(blocks),
        "adapters alone": lambda: Adapters(adapted),
        "same bytes again": lambda: Policy(backbone, head),
        "all changed": lambda: Policy(backbone, head),
        "every leaf copied": lambda: Policy(backbone, head),
    }
    cases = {name: Case(name, make) for name, make in makers.items()}
    floor = Floor(backbone + head)
    order: list = [*cases.values(), floor]
    try:
        for r in range(rounds + 3):
            for one in order[r % len(order) :] + order[: r % len(order)]:
                one.step(timed=r >= 3)

        def ratio(a: list[float], b: list[float]) -> float:
            return statistics.median(x / y for x, y in zip(a, b))

        ratios = {
            "frozen + head": ratio(cases["frozen + head"].total(), cases["head alone"].total()),
            "adapted": ratio(cases["adapted"].total(), cases["adapters alone"].total()),
            "all changed": ratio(cases["all changed"].times["publish"], cases["every leaf copied"].times["publish"]),
            "all changed, floor": ratio(cases["all changed"].times["publish"], floor.times["publish"]),
        }
    finally:
        medians = {name: c.close() for name, c in cases.items()}
    return medians, ratios, statistics.median(floor.times["publish"])


def describe(model: nn.Module) -> str:
    tensors = list(model.state_dict().values())
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    trained = sum(t.numel() * t.element_size() for t in model.trained())
    modules = sum(1 for _ in model.modules())
    return f"{len(tensors)} tensors in {modules} modules, {nbytes / MB:.0f} MB, {100 * trained / nbytes:.1f}% trained"


def fmt(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 MB frozen + 1 MB trained; a 25 MB adapted model")
    parser.add_argument("--rounds", type=int, default=40, help="publishes per case (default 40)")
    parser.add_argument("--compare", action="store_true", help="prove unchanged leaves by comparison")
    parser.add_argument("--docs", action="store_true", help="also write docs/results/frozen_bench.md")
    args = parser.parse_args(argv)
    if args.compare:
        os.environ["SHMSYNC_WRITE_TRACKING"] = "0"
    torch.set_num_threads(1)  # as TorchRL sets a trainer beside its workers on 2 cores
    backbone, head, blocks = (32 * MB, MB, 3) if args.quick else (128 * MB, 4 * MB, 12)
    from shmsync.core.header import Proof

    medians, ratios, floor = measure(backbone, head, blocks, args.rounds)
    lines = [
        f"{backbone // MB} MB frozen + {head // MB} MB trained; the adapted model: "
        f"{describe(AdaptedModel(blocks))}; one torch thread, {args.rounds} publishes per case, medians; "
        f"unchanged proved by: {Proof.of_word(int(medians['frozen + head']['proof']))}",
        "",
        "| case | publish | bytes copied | copying reader's reload | in-place reader's reload "
        "| publish + copying reload |",
        "|---|---|---|---|---|---|",
    ]
    for case, m in medians.items():
        lines.append(
            f"| {case} | {fmt(m['publish'])} | {m['copied'] / MB:.2f} MB | {fmt(m['copying reload'])} "
            f"| {fmt(m['in-place reload'])} | {fmt(m['publish'] + m['copying reload'])} |"
        )
    lines.append(f"| floor: one copy of everything, as a publish copies | {fmt(floor)} | | | | |")
    lines += [
        "",
        "Publish + copying reload, round by round:",
        "",
        f"- frozen + head against head alone: **{ratios['frozen + head']:.2f}x** (goal: at most 1.3x)",
        f"- adapted against adapters alone: **{ratios['adapted']:.2f}x** (goal: at most 1.5x)",
        f"- same bytes again: {medians['same bytes again']['copied']:.0f} bytes copied (goal: 0)",
        f"- all changed against every leaf copied without looking, publish: **{ratios['all changed']:.2f}x** "
        f"(goal: at most 1.05x); against the floor {ratios['all changed, floor']:.2f}x",
    ]
    text = "\n".join(lines)
    print(text)
    if args.docs:
        from provenance import write

        write("frozen_bench" + ("_compare" if args.compare else ""), text, MEASURES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
