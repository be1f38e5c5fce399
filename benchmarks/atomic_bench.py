"""What torn-free versions cost, per policy call and per update: shmsync beside TorchRL's shared
buffer (``SharedMemWeightSyncScheme``, which a policy call may read mid-update: ``atomic=False``
in TorchRL's 0.15 docs) and beside the two costs TorchRL documents for ``atomic=True`` (a copy
through a staging buffer per update, a lock held around every policy call), in one run.

    python benchmarks/atomic_bench.py           # 1 MB and 16 MB
    python benchmarks/atomic_bench.py --quick

``atomic=True`` is in no torchrl release or nightly on the package index yet (torchrl-nightly
2026.10.27 has no such argument), so its two documented costs are timed here as the calls they
take at the least: an uncontended ``multiprocessing.Lock`` taken and released around the call,
and a second copy of the weights per update. One process, one torch thread; ratios only.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch
from tensordict import TensorDict
from torch import nn

from shmsync import WeightReader, WeightStore

SIZES = {"1MB": 1 << 20, "16MB": 16 << 20}


def policy_of(nbytes: int) -> nn.Module:
    """An MLP of about ``nbytes`` of float32 weights, called on one observation."""
    width = max(8, int((nbytes / 4 / 2) ** 0.5))
    return nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))


def median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def per_call(policy: nn.Module, nbytes: int, repeat: int) -> dict[str, float]:
    """A policy call, and what each scheme adds to every call (us): shmsync's version check
    (nothing new), an uncontended lock taken and released (held by an update, it waits for
    that update's copies)."""
    x = torch.zeros(1, policy[0].in_features)
    with WeightStore.create(policy) as store:
        worker = policy_of(nbytes)  # a worker's module: the same layout
        reader = WeightReader(store, worker)
        reader.poll()
        lock = mp.Lock()

        def locked():
            lock.acquire()
            lock.release()

        with torch.no_grad():
            call = median_us(lambda: worker(x), repeat)
        shmsync = median_us(reader.poll, repeat)  # the version check: nothing new
        atomic = median_us(locked, repeat)
        reader.close()
    return {"call": call, "shmsync": shmsync, "atomic_lock": atomic}


def per_update(policy: nn.Module, repeat: int) -> dict[str, float]:
    """One update (us): a plain copy, TorchRL's shared-buffer update, a staging copy more, and
    shmsync's publish."""
    weights = TensorDict.from_module(policy).data
    shared = weights.clone().share_memory_()
    staging = weights.clone().share_memory_()
    lock = mp.Lock()
    src, dst = list(weights.values(True, True)), list(shared.values(True, True))

    def atomic_update():
        staging.update_(weights)  # the copy into the staging buffer
        with lock:  # the buffer the workers read, swapped under the lock the calls hold
            shared.update_(staging)

    with WeightStore.create(policy) as store:
        out = {
            "copy": median_us(lambda: torch._foreach_copy_(dst, src), repeat),
            "sharedmem": median_us(lambda: shared.update_(weights), repeat),
            "atomic_copies": median_us(atomic_update, repeat),
            "shmsync": median_us(lambda: store.publish(policy), repeat),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    repeat = 200 if args.quick else 2000
    print("| model | policy call | shmsync adds | atomic=True's lock adds | update: one copy | SharedMem | "
          "atomic=True's copies | shmsync publish |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, nbytes in SIZES.items():
        policy = policy_of(nbytes)
        calls = per_call(policy, nbytes, repeat)
        updates = per_update(policy, max(20, repeat // (20 if nbytes > 4 << 20 else 4)))
        c = updates["copy"]
        print(
            f"| {name} | {calls['call']:.1f} us | {calls['shmsync']:.2f} us ({calls['shmsync'] / calls['call']:.1%}) "
            f"| {calls['atomic_lock']:.2f} us ({calls['atomic_lock'] / calls['call']:.1%}) | {c:.0f} us | "
            f"{updates['sharedmem'] / c:.2f}x | {updates['atomic_copies'] / c:.2f}x | {updates['shmsync'] / c:.2f}x |"
        )


if __name__ == "__main__":
    main()
