"""The training loop per batch, where users feel weight sync: update, train, take the next batch,
timed whole, with TorchRL's default scheme and a floor beside shmsync in one run.

    python benchmarks/loop_bench.py             # 1, 16 and 128 MB, both cases (about 15 minutes on 2 cores)
    python benchmarks/loop_bench.py --quick     # 1 and 16 MB, fewer batches
    python benchmarks/loop_bench.py --docs      # also write docs/results/loop_bench.md

Each loop is a trainer's: an Adam step on every weight of the policy (a real optimizer, timed as
part of the loop), ``update_policy_weights_`` before or after it, then the next batch of a
``MultiSyncCollector`` of 2 workers on Pendulum. Three collectors take turns batch by batch, so
that the machine's drift hits all alike:

* ``shmsync``: ``ShmWeightSyncScheme()`` with its defaults;
* ``TorchRL``: TorchRL's default scheme for a module policy, ``SharedMemWeightSyncScheme()``;
* ``floor``: no weight sync at all (TorchRL's ``NoWeightSyncScheme``) and one plain copy of the
  weights into shared memory per batch: the least any scheme that copies once can cost.

Two cases:

* ``every weight trained``: the collector's own policy, updated with no argument
  (``update_policy_weights_()``), in both of TorchRL's call orders: update, then train (``sac.py``,
  ``td3.py``, ``ddpg.py``) and train, then update (``ppo.py``, ``dqn.py``);
* ``weights passed``: a module of the trainer's own (a loss module's copy) trained, then its weights
  passed (``update_policy_weights_(weights)``).

Reported per case and payload: the median loop per batch of each collector, and round by round
(the median of each round's ratio): shmsync's loop against TorchRL's (the goal: at most 1.05x)
and against the floor, and the optimizer step of shmsync's loop against the floor's (no shmsync
attached there: the goal, at most 1.02x).
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
import warnings

import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

warnings.filterwarnings("ignore")

MB = 1 << 20
KINDS = ("shmsync", "TorchRL", "floor")
ORDERS = ("update, then train", "train, then update")
MEASURES = [
    "benchmarks/loop_bench.py",
    "shmsync/torchrl",
    "shmsync/writer",
    "shmsync/reader",
    "shmsync/store",
    "shmsync/core",
]


class PayloadPolicy(nn.Module):
    """A Pendulum policy carrying ``nbytes`` of weights in four tensors and a head. Each call reads
    one number from every 4 KB page of them, as a real policy reads all its weights (every page
    mapped in the worker), at a fraction of a real forward's cost."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.head = nn.Linear(3, 1)
        self.payload = nn.ParameterList(nn.Parameter(0.01 * torch.randn(max(1, nbytes // 16 - 4))) for _ in range(4))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        read = sum(p[::1024].sum() for p in self.payload)
        return 2 * torch.tanh(self.head(observation) + 1e-6 * read)

    def loss(self, observation: torch.Tensor) -> torch.Tensor:
        """A loss whose gradient reaches every weight (so Adam steps them all)."""
        return self.head(observation).sum() + sum((p * p).sum() for p in self.payload)


def make_policy(nbytes: int) -> TensorDictModule:
    return TensorDictModule(PayloadPolicy(nbytes), in_keys=["observation"], out_keys=["action"])


def make_env():
    from torchrl.envs import GymEnv

    return GymEnv("Pendulum-v1")


class Loop:
    """One collector, the module its trainer trains, and that trainer's optimizer and update."""

    def __init__(self, kind: str, nbytes: int, passed: bool, frames: int) -> None:
        from torchrl.collectors import MultiSyncCollector
        from torchrl.weight_update import NoWeightSyncScheme, SharedMemWeightSyncScheme

        from shmsync import ShmWeightSyncScheme

        self.kind = kind
        policy = make_policy(nbytes)
        scheme = {"shmsync": ShmWeightSyncScheme, "TorchRL": SharedMemWeightSyncScheme, "floor": NoWeightSyncScheme}
        # The floor's workers build their own policy: nothing is sent to them, ever.
        given = {"policy_factory": functools.partial(make_policy, nbytes)} if kind == "floor" else {"policy": policy}
        self.collector = MultiSyncCollector(
            [make_env] * 2,
            frames_per_batch=frames,
            total_frames=-1,
            weight_sync_schemes={"policy": scheme[kind]()},
            **given,
        )
        self.batches = iter(self.collector)
        self.trained = make_policy(nbytes) if passed else policy
        self.optimizer = torch.optim.Adam(self.trained.parameters(), lr=1e-4)
        self.observation = torch.randn(64, 3)
        if kind == "floor":
            params = [p.detach() for p in self.trained.parameters()]
            shared = [torch.empty_like(p).share_memory_() for p in params]
            self.update = functools.partial(torch._foreach_copy_, shared, params)
        elif passed:
            self.update = functools.partial(self.collector.update_policy_weights_, TensorDict.from_module(self.trained))
        else:
            self.update = self.collector.update_policy_weights_
        self.loops: list[float] = []
        self.steps: list[float] = []

    def train(self) -> float:
        """One optimizer step on every weight; returns how long the step alone took."""
        self.optimizer.zero_grad()
        self.trained.module.loss(self.observation).backward()
        start = time.perf_counter()
        self.optimizer.step()
        return time.perf_counter() - start

    def batch(self, order: str, timed: bool) -> None:
        start = time.perf_counter()
        if order == ORDERS[0]:
            self.update()
            step = self.train()
        else:
            step = self.train()
            self.update()
        next(self.batches)
        if timed:
            self.loops.append(time.perf_counter() - start)
            self.steps.append(step)

    def close(self) -> None:
        self.collector.shutdown()


def measure(nbytes: int, case: str, order: str, batches: int, frames: int) -> dict:
    """The three collectors, taking turns batch by batch, after three batches each to start."""
    loops = {kind: Loop(kind, nbytes, case == "weights passed", frames) for kind in KINDS}
    try:
        for b in range(batches + 3):
            for loop in loops.values():
                loop.batch(order, timed=b >= 3)
    finally:
        for loop in loops.values():
            loop.close()
    shm, torchrl, floor = (loops[k] for k in KINDS)

    def ratio(a: list[float], b: list[float]) -> float:
        return statistics.median(x / y for x, y in zip(a, b))

    result = {
        "MB": nbytes // MB,
        "case": case,
        "order": order,
        "loop": {k: statistics.median(v.loops) for k, v in loops.items()},
        "vs TorchRL": ratio(shm.loops, torchrl.loops),
        "vs floor": ratio(shm.loops, floor.loops),
        "step vs floor": ratio(shm.steps, floor.steps),
    }
    del loops
    gc.collect()
    return result


def fmt(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def render(results: list[dict], batches: int, frames: int) -> str:
    from provenance import machine

    lines = [
        f"{machine()}; MultiSyncCollector, 2 workers on Pendulum, {frames} frames per batch, an Adam step on every "
        f"trained weight, {batches} batches per collector and case, medians (ratios: the median of each round's)",
        "",
        "| case | order | payload | loop per batch: shmsync | TorchRL | floor | shmsync / TorchRL | shmsync / floor "
        "| optimizer step: shmsync / floor |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        loop = r["loop"]
        lines.append(
            f"| {r['case']} | {r['order']} | {r['MB']} MB | {fmt(loop['shmsync'])} | {fmt(loop['TorchRL'])} "
            f"| {fmt(loop['floor'])} | **{r['vs TorchRL']:.2f}x** | {r['vs floor']:.2f}x | {r['step vs floor']:.2f}x |"
        )
    lines += [
        "",
        "Goals: shmsync / TorchRL at most 1.05x with every weight trained, at most 1.00x with the weights passed; "
        "the optimizer step at most 1.02x the floor's (no shmsync attached).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 and 16 MB, 20 batches")
    parser.add_argument("--batches", type=int, default=None, help="batches per collector and case (default 40)")
    parser.add_argument("--frames", type=int, default=32, help="frames per batch (default 32)")
    parser.add_argument("--sizes", default=None, help="payloads in MB, comma-separated (default 1,16,128)")
    parser.add_argument(
        "--cases", default="trained,passed", help="trained (every weight, no argument), passed (weights passed)"
    )
    parser.add_argument("--docs", action="store_true", help="also write docs/results/loop_bench.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # as TorchRL sets the trainer beside its workers on 2 cores
    sizes = [int(s) for s in (args.sizes or ("1,16" if args.quick else "1,16,128")).split(",")]
    batches = args.batches or (20 if args.quick else 40)
    runs = []
    for case in args.cases.split(","):
        if case == "trained":
            runs += [("every weight trained", order, mb) for mb in sizes for order in ORDERS]
        elif case == "passed":
            runs += [("weights passed", ORDERS[1], mb) for mb in sizes]
        else:
            parser.error(f"unknown case {case!r}: trained or passed")
    results = []
    for case, order, mb in runs:
        r = measure(mb * MB, case, order, batches, args.frames)
        results.append(r)
        print(f"  {case}, {order}, {mb} MB: shmsync / TorchRL {r['vs TorchRL']:.2f}x", file=sys.stderr)
    text = render(results, batches, args.frames)
    print(text)
    if args.docs:
        from provenance import write

        write("loop_bench", text, MEASURES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
