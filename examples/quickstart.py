"""Quickstart: one trainer process publishes, two worker processes reload lazily.

    python examples/quickstart.py

The trainer "trains" a small policy (random gradient steps) and publishes every few
steps; each worker polls between its own steps and prints every version it loads, while
training runs: workers reload lazily, only when a new version was published.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass

import torch
from torch import nn

from shmsync import WeightReader, WeightStore
from shmsync.tools.ctrl_c import CtrlC


@dataclass
class Args:
    steps: int = 40  # trainer optimizer steps
    publish_every: int = 5  # steps between publishes
    workers: int = 2
    step_seconds: float = 0.05  # pace of the "training", so workers see each version


def make_policy() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 2))


def worker(store: WeightStore, worker_id: int, last_version: int) -> None:
    # The store arrives pickled: the child attaches to the same shared memory by name.
    with torch.device("meta"):
        policy = make_policy()  # no memory until the first load
    reader = WeightReader(store, policy)
    obs = torch.randn(1, 8)
    while reader.version < last_version:
        if reader.poll():  # ~70 ns when nothing changed
            print(f"worker {worker_id}: loaded version {reader.version}", flush=True)
        with torch.no_grad():
            policy(obs)  # act with exactly one version of the weights
        time.sleep(0.001)
    store.close()


def main(args: Args) -> None:
    policy = make_policy()
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.01)
    last_version = args.steps // args.publish_every
    ctx = mp.get_context("spawn")
    # A Ctrl-C stops the trainer after its step at hand; the workers never see it (they are stopped).
    with CtrlC() as ctrl_c, WeightStore.create(policy) as store:  # the creator removes the shared memory
        procs = [ctx.Process(target=worker, args=(store, i, last_version)) for i in range(args.workers)]
        with ctrl_c.shielded():
            for p in procs:
                p.start()
        try:
            # Wait until every worker has attached and loaded version 0 (they start in ~1-2 s).
            while sum(r.version >= 0 for r in store.readers(processes=False)) < args.workers and not ctrl_c.pressed:
                time.sleep(0.05)
            for step in range(1, args.steps + 1):
                if ctrl_c.pressed:
                    break
                loss = policy(torch.randn(32, 8)).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
                if step % args.publish_every == 0:
                    version = store.publish(policy)  # never waits for the workers
                    print(f"trainer: step {step}, published version {version}", flush=True)
                time.sleep(args.step_seconds)
            for p in procs:
                p.join(timeout=0 if ctrl_c.pressed else 30)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        print("stopped by Ctrl-C" if ctrl_c.pressed else "done", f"at version {store.version}")


if __name__ == "__main__":
    main(Args())
