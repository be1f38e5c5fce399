"""shmsync side by side with TorchRL's weight-sync schemes and with the memory-copy limit.

    python benchmarks/sync_bench.py            # full run (a few minutes on 2 cores)
    python benchmarks/sync_bench.py --quick    # under a minute
    python benchmarks/sync_bench.py --out results.json

Everything is measured in one run on one machine; compare ratios, not absolute times.
All in-process timings use one torch thread: TorchRL's multi-process collectors set the
trainer to max(1, cores - workers) threads, which is 1 on a 2-core machine.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
import warnings
from pathlib import Path

import psutil
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

# The code this benchmark's results measure (benchmarks/provenance.py).
MEASURES = [
    "benchmarks/sync_bench.py",
    "shmsync/torchrl",
    "shmsync/writer",
    "shmsync/reader",
    "shmsync/store",
    "shmsync/core",
]

warnings.filterwarnings("ignore")
os.environ.setdefault("RL_WARNINGS", "False")

SIZES = {"4KB": 4 << 10, "1MB": 1 << 20, "16MB": 16 << 20, "128MB": 128 << 20}


# -- a Pendulum policy carrying a payload of the requested size --------------------------------
class PayloadPolicy(nn.Module):
    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.head = nn.Linear(3, 1)
        self.payload = nn.Parameter(torch.zeros(max(1, nbytes // 4 - 4)))

    def forward(self, observation: torch.Tensor) -> torch.Tensor:
        return 2 * torch.tanh(self.head(observation))


def make_policy(nbytes: int) -> TensorDictModule:
    return TensorDictModule(PayloadPolicy(nbytes), in_keys=["observation"], out_keys=["action"])


def make_env():
    from torchrl.envs import GymEnv

    return GymEnv("Pendulum-v1")


# -- measurement helpers ------------------------------------------------------------------------
def timed(fn, reps: int, warmup: int = 3) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def p50(xs):
    return statistics.median(xs)


def p95(xs):
    return sorted(xs)[min(len(xs) - 1, int(0.95 * len(xs)))]


def shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def uss_tree() -> int:
    total = 0
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            total += p.memory_full_info().uss
        except psutil.Error:
            pass
    return total


def fmt_t(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt_b(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def table(title: str, head: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    line = "  ".join(h.ljust(w) for h, w in zip(head, widths))
    out = [f"\n## {title}", line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def reps_for(nbytes: int, quick: bool) -> int:
    base = 2000 if nbytes <= 4096 else 400 if nbytes <= 1 << 20 else 300 if nbytes <= 16 << 20 else 30
    return max(5, base // 4) if quick else base


# -- 1. trainer side, no workers: publish against the copy floor --------------------------------
def interleaved(fns: dict, reps: int, warmup: int = 3, before=None) -> dict[str, list[float]]:
    """Time each function once per round, round after round, so drift hits all alike; the
    order within a round is shuffled, so no function always runs on the caches another left.
    ``before`` (untimed) runs ahead of each call."""
    out = {k: [] for k in fns}
    order = list(fns)
    rng = random.Random(0)
    for r in range(warmup + reps):
        rng.shuffle(order)
        for k in order:
            fn = fns[k]
            if before is not None:
                before(k)
            t = time.perf_counter()
            fn()
            if r >= warmup:
                out[k].append(time.perf_counter() - t)
    return out


def rotating_copy(dsts: list[list[torch.Tensor]], src: list[torch.Tensor]):
    """A plain per-tensor ``copy_`` of ``src`` into each destination set in turn."""
    turn = [0]

    def copy():
        turn[0] = (turn[0] + 1) % len(dsts)
        for d, s in zip(dsts[turn[0]], src):
            d.copy_(s)

    return copy


def weights(module: nn.Module) -> list[torch.Tensor]:
    return [t.data for t in module.parameters()]


def slot_views(store, module: nn.Module, prefix: tuple[str, ...] = ()) -> list[list[torch.Tensor]]:
    """Per slot of ``store``, its views of ``module``'s parameters (same order as :func:`weights`)."""
    index = store.memory.layout.index
    keys = [prefix + tuple(name.split(".")) for name, _ in module.named_parameters()]
    return [[views[index[k]] for k in keys] for views in store.memory.map_slots()]


def empty_like_all(tensors: list[torch.Tensor], shared: bool = False) -> list[torch.Tensor]:
    return [torch.empty_like(t).share_memory_() if shared else torch.empty_like(t) for t in tensors]


def bench_publish(sizes: dict[str, int], quick: bool) -> list[dict]:
    from shmsync import WeightStore

    results = []
    for label, nbytes in sizes.items():
        policy = make_policy(nbytes)
        store = WeightStore.create(policy)
        # The floors copy the very tensors publish() reads (all of them), so caches treat them alike.
        src = weights(policy)
        private = [empty_like_all(src) for _ in range(2)]
        shared = [empty_like_all(src, shared=True) for _ in range(3)]
        times = interleaved(
            {
                "copy_warm": rotating_copy(private[:1], src),
                "copy_2_alternating": rotating_copy(private, src),
                "copy_3_rotating_shm": rotating_copy(shared, src),
                # Separate allocations of the same size differ by up to ~20% in copy speed on this
                # VM (physical placement), so the like-for-like floor writes publish's own pages.
                "copy_same_slots": rotating_copy(slot_views(store, policy), src),
                "publish": lambda store=store, policy=policy: store.publish(policy),
            },
            reps_for(nbytes, quick),
        )
        store.close()
        results.append({"payload": label, "bytes": nbytes, **times})
        del src, private, shared
        gc.collect()
    return results


def bench_parallel_publish(sizes: dict[str, int], quick: bool) -> list[dict]:
    """publish() with its copy on one thread and split across the cores (the default), against
    plain copies into the same slots on one thread and on as many threads."""
    from shmsync import WeightStore
    from shmsync.store.copies import copy_all, copy_threads

    threads = copy_threads()
    results = []
    for label, nbytes in sizes.items():
        policy = make_policy(nbytes)
        store = WeightStore.create(policy)
        src = weights(policy)
        dsts = slot_views(store, policy)
        turn = [0]

        def floor(n, src=src, dsts=dsts, turn=turn):
            turn[0] += 1
            copy_all(dsts[turn[0] % len(dsts)], src, True, n)

        def publish_with(n, store=store, policy=policy):
            os.environ["SHMSYNC_COPY_THREADS"] = str(n)
            try:
                store.publish(policy)
            finally:
                del os.environ["SHMSYNC_COPY_THREADS"]

        times = interleaved(
            {
                "copy_1_thread": lambda: floor(1),
                f"copy_{threads}_threads": lambda: floor(threads),
                "publish_1_thread": lambda: publish_with(1),
                f"publish_{threads}_threads": lambda: publish_with(threads),
            },
            reps_for(nbytes, quick),
        )
        store.close()
        results.append({"payload": label, "bytes": nbytes, "threads": threads, **times})
        del src, dsts
        gc.collect()
    return results


def bench_background(nbytes: int, reps: int) -> dict:
    """publish() with the opt-in ``unsafe_background_copy=True`` on the trainer's thread (the copy
    lands on the store's copier thread, waited for outside the timing), against one plain copy_ of
    the same tensors. The opt-in gives up the snapshot; the default copies before returning."""
    from shmsync import WeightStore

    policy = make_policy(nbytes)
    src = weights(policy)
    dst = empty_like_all(src)
    store = WeightStore.create(policy, unsafe_background_copy=True)
    try:
        times = interleaved(
            {"copy": rotating_copy([dst], src), "background_publish": lambda: store.publish(policy)},
            reps,
            before=lambda _key: store.flush(),
        )
    finally:
        store.close()
    return {"bytes": nbytes, **times}


def bench_reader_table(quick: bool) -> dict:
    """publish() at 4 KB into a store with 1,000 readers listed against one with 2: the writer
    must not pay for the size of the reader table."""
    from shmsync import WeightReader, WeightStore

    stores, readers = {}, []
    for n in (2, 1000):
        policy = make_policy(4 << 10)
        stores[n] = (WeightStore.create(policy), policy)
        readers += [WeightReader(stores[n][0], make_policy(4 << 10)) for _ in range(n)]
    assert len(stores[1000][0].readers()) == 1000
    times = interleaved(
        {f"publish_{n}_readers": (lambda s=s, p=p: s.publish(p)) for n, (s, p) in stores.items()},
        2000 if quick else 10_000,
    )
    for r in readers:
        r.close()
    for s, _ in stores.values():
        s.close()
    return times


# -- 2. worker side: version check and reload against the copy floor ----------------------------
def bench_reader(sizes: dict[str, int], quick: bool) -> dict:
    from shmsync import WeightReader, WeightStore

    policy = make_policy(4096)
    store = WeightStore.create(policy)
    reader = WeightReader(store, make_policy(4096))
    reader.poll()
    n = 200_000 if not quick else 50_000
    t = time.perf_counter()
    for _ in range(n):
        reader.poll()
    check = (time.perf_counter() - t) / n
    store.close()
    reloads = []
    for label, nbytes in sizes.items():
        if nbytes < 1 << 20:
            continue
        policy = make_policy(nbytes)
        store = WeightStore.create(policy)
        worker = make_policy(nbytes)
        reader = WeightReader(store, worker, zero_copy=False)
        # The floor copies the same tensors out of the same slot, one plain copy_ each.
        copy_floor = rotating_copy([weights(worker)], slot_views(store, worker)[0])
        viewer = WeightReader(store, make_policy(nbytes), zero_copy=True)
        times = interleaved(
            {"reload": reader.reload, "copy_floor": copy_floor, "zero_copy_reload": viewer.reload},
            reps_for(nbytes, quick),
        )
        reloads.append({"payload": label, "bytes": nbytes, **times})
        store.close()
        gc.collect()
    return {"version_check_s": check, "reload": reloads}


# -- 3. trainer side with 2 workers: update_policy_weights_() per scheme -------------------------
PRIVATE = "shmsync private copy"  # zero_copy=False: each worker copies into weights of its own
ONE_THREAD = "shmsync 1 thread"  # every copy on one core (SHMSYNC_COPY_THREADS=1), trainer and workers


def copy_threads_for(kind: str) -> None:
    """Set the copy-thread count for ``kind`` (before its collector spawns workers, which inherit it)."""
    if kind == ONE_THREAD:
        os.environ["SHMSYNC_COPY_THREADS"] = "1"
    else:
        os.environ.pop("SHMSYNC_COPY_THREADS", None)


def make_scheme(kind: str):
    if kind.startswith("shmsync"):
        from shmsync import ShmWeightSyncScheme

        return ShmWeightSyncScheme(zero_copy=False if kind == PRIVATE else None)
    from torchrl.weight_update import MultiProcessWeightSyncScheme, SharedMemWeightSyncScheme

    return {"SharedMem": SharedMemWeightSyncScheme, "MultiProcess": MultiProcessWeightSyncScheme}[kind]()


def build_collector(kind: str, nbytes: int, workers: int, cls_name: str = "MultiSyncCollector", fpb: int = 200):
    import torchrl.collectors as C

    cls = getattr(C, cls_name)
    policy = make_policy(nbytes)
    scheme = make_scheme(kind)
    collector = cls(
        [make_env] * workers,
        policy,
        frames_per_batch=fpb,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
    )
    collector.bench_scheme = scheme
    return collector, policy


def bench_update(sizes: dict[str, int], kinds: list[str], workers: int, quick: bool) -> list[dict]:
    results = []
    for label, nbytes in sizes.items():
        for kind in kinds:
            if kind == "MultiProcess" and nbytes > 16 << 20:
                continue  # it keeps 2x the payload in shared memory after shutdown
            shm0, uss0 = shm_used(), uss_tree()
            collector, policy = build_collector(kind, nbytes, workers)
            try:
                next(iter(collector))  # workers up and weights initialized
                reps = max(5, reps_for(nbytes, quick) // 5)
                # The trainer's own copy of the weights (a loss module's, say), sent explicitly.
                trainer_module = make_policy(nbytes)
                trainer_weights = TensorDict.from_module(trainer_module)
                fns = {
                    "update": collector.update_policy_weights_,
                    "update_explicit": lambda c=collector, w=trainer_weights: c.update_policy_weights_(w),
                }
                sources = {"update": weights(policy), "update_explicit": weights(trainer_module)}
                if kind == "shmsync":
                    # The floor for any design that copies once: a plain copy_ of the same tensors
                    # into the same shared-memory slots, timed here, in the same conditions.
                    store = collector.bench_scheme.store
                    fns["copy_floor"] = rotating_copy(slot_views(store, policy, ("policy",)), sources["update"])
                    sources["copy_floor"] = sources["update"]

                def before(key, sources=sources):
                    # As after an optimizer step: the weights to send were just written.
                    with torch.no_grad():
                        torch._foreach_mul_(sources[key], 1.0)

                times = interleaved(fns, reps, warmup=2, before=before)
                lat = times["update"]
                del fns, sources, before
                shm1, uss1 = shm_used(), uss_tree()
            finally:
                collector.shutdown()
            del collector, policy
            gc.collect()
            time.sleep(0.2)
            results.append(
                {
                    "payload": label,
                    "bytes": nbytes,
                    "scheme": kind,
                    "workers": workers,
                    "update": lat,
                    "update_explicit": times["update_explicit"],
                    "copy_floor": times.get("copy_floor"),
                    "shm_bytes": shm1 - shm0,
                    "uss_bytes": uss1 - uss0,
                    "shm_left_after_shutdown": max(0, shm_used() - shm0),
                }
            )
            print(f"  update {label:>5} {kind:<12} p50 {fmt_t(p50(lat))}", file=sys.stderr, flush=True)
    return results


def bench_real_loop(nbytes: int, kinds: list[str], reps: int) -> list[dict]:
    """update_policy_weights_(trainer's weights) as a training loop makes it: a batch collected
    before every call, nothing written to the weights just before (caches as they are). For
    shmsync, every other call is replaced by a plain copy_ of the same tensors into the store's
    slots: the floor, in the same position of the same loop."""
    results = []
    for kind in kinds:
        collector, policy = build_collector(kind, nbytes, 2)
        try:
            it = iter(collector)
            next(it)
            trainer_module = make_policy(nbytes)
            trainer_weights = TensorDict.from_module(trainer_module)
            calls = {"update": functools.partial(collector.update_policy_weights_, trainer_weights)}
            if kind == "shmsync":
                store = collector.bench_scheme.store
                calls["copy_floor"] = rotating_copy(
                    slot_views(store, trainer_module, ("policy",)), weights(trainer_module)
                )
                source = {"policy": trainer_weights}
                calls["publish"] = functools.partial(store.publish, source)  # the store alone, no collector
            times: dict[str, list[float]] = {k: [] for k in calls}
            names = list(calls)
            for i in range(4 + len(names) * reps):
                next(it)
                which = names[i % len(names)]
                t = time.perf_counter()
                calls[which]()
                if i >= 4:
                    times[which].append(time.perf_counter() - t)
        finally:
            collector.shutdown()
        del collector, policy
        gc.collect()
        results.append({"scheme": kind, "bytes": nbytes, **times})
        print(f"  real loop {kind:<10} p50 {fmt_t(p50(times['update']))}", file=sys.stderr, flush=True)
    return results


# -- 3b. a slow reader beside a writer publishing flat out --------------------------------------
class Payload(nn.Module):
    def __init__(self, nbytes: int) -> None:
        super().__init__()
        n = nbytes // 4 // 4
        for i in range(4):
            self.register_buffer(f"b{i}", torch.zeros(n))


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def _slow_reader(name: str, nbytes: int, seconds: float, pin_first: bool, conn) -> None:
    from shmsync import WeightReader, WeightStore
    from shmsync.core.protocol import SlotReader

    os.nice(10)
    torch.set_num_threads(1)
    if not pin_first:  # the reader as it was: optimistic copies first, whatever their length
        SlotReader.outpaced = lambda self: False
    store = WeightStore.attach(name)
    reader = WeightReader(store, Payload(nbytes), zero_copy=False)
    conn.send("ready")
    loads, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        loads += reader.reload()
    # The ceiling: plain copies of the same bytes, in the same conditions (the writer still
    # publishes, the busy process still spins), torn or not.
    targets = list(reader.module.buffers())  # b0..b3: the layout order
    copies = []
    for _ in range(3):
        began = time.perf_counter_ns()
        for dst, src in zip(targets, store.memory.map_slots()[0]):
            dst.copy_(src)
        copies.append(time.perf_counter_ns() - began)
    copy_ns = statistics.median(copies)
    slot_reader = reader._binding.slot_reader  # counts this reader's failed copies and pinned reads
    conn.send(
        {"loads": loads, "failed_copies": slot_reader.retries, "pinned": slot_reader.pinned_reads, "copy_ns": copy_ns}
    )
    reader.close()
    store.close()


def bench_slow_reader(nbytes: int, seconds: float) -> list[dict]:
    """A reader niced beside a busy process, its copy slower than the writer's publishes (which
    run back to back): loads per minute and failed copies per load, asking for the pin at once
    when outpaced (shmsync) against optimistic copies first."""
    import multiprocessing as mp

    from shmsync import WeightStore

    ctx = mp.get_context("spawn")
    source = Payload(nbytes)
    results = []
    for pin_first in (True, False):
        store = WeightStore.create(source)
        parent, child = ctx.Pipe()
        reader = ctx.Process(target=_slow_reader, args=(store.name, nbytes, seconds, pin_first, child))
        busy = ctx.Process(target=_spin, args=(seconds + 30,))
        reader.start()
        try:
            assert parent.poll(60) and parent.recv() == "ready"
            busy.start()
            publishes, end = 0, time.monotonic() + seconds
            while time.monotonic() < end or not parent.poll(0):
                store.publish(source)
                publishes += 1
                if time.monotonic() > end + 60:
                    raise RuntimeError("the slow reader did not report")
            got = parent.recv()
        finally:
            for p in (reader, busy):
                if p.is_alive():
                    p.kill()
                p.join(10)
            store.close()
        loads = max(got["loads"], 1)
        results.append(
            {
                "mode": "pin first when outpaced" if pin_first else "optimistic first",
                "bytes": nbytes,
                "seconds": seconds,
                "loads_per_min": got["loads"] * 60 / seconds,
                "failed_copies_per_load": got["failed_copies"] / loads,
                "pinned_share": got["pinned"] / loads,
                "one_copy_per_load_per_min": 60e9 / max(got["copy_ns"], 1),
                "publishes": publishes,
            }
        )
        print(f"  slow reader: {results[-1]}", file=sys.stderr, flush=True)
    return results


# -- 4. collection throughput, publishing after every batch against never ------------------------
def bench_throughput(
    sizes: dict[str, int], kinds: list[str], classes: list[str], batches: int, explicit: tuple[str, ...] = ()
) -> list[dict]:
    """``explicit``: payloads also measured sending the trainer's separate copy of the weights."""
    results = []
    cases = [(label, nbytes, False) for label, nbytes in sizes.items()]
    cases += [(label, sizes[label], True) for label in explicit]
    for cls_name in classes:
        for label, nbytes, send_copy in cases:
            for kind in kinds:
                if kind == ONE_THREAD and nbytes < 4 << 20:
                    continue  # below the size copies are split at: the same as shmsync
                copy_threads_for(kind)
                collector, policy = build_collector(kind, nbytes, 2, cls_name)
                trainer_weights = TensorDict.from_module(make_policy(nbytes)) if send_copy else None
                frames = {"never": 0, "every_batch": 0}
                cycles = {"never": [], "every_batch": []}
                updates = []
                try:
                    it = iter(collector)
                    for _ in range(3):
                        next(it)  # warm up
                    # Alternate the two modes so drift and noise from the machine hit both alike:
                    # cycle by cycle for the sync collector (a cycle is publish-or-not + next batch);
                    # in chunks for the async one, whose queued batches blur single cycles.
                    chunk = 1 if cls_name == "MultiSyncCollector" else max(1, batches // 3)
                    for i in range(2 * batches):
                        mode = "never" if (i // chunk) % 2 == 0 else "every_batch"
                        t = time.perf_counter()
                        if mode == "every_batch":
                            collector.update_policy_weights_(trainer_weights)
                            updates.append(time.perf_counter() - t)
                        frames[mode] += next(it).numel()
                        cycles[mode].append(time.perf_counter() - t)
                finally:
                    collector.shutdown()
                    copy_threads_for("")
                del collector, policy
                gc.collect()
                seconds = {m: sum(v) for m, v in cycles.items()}
                fps = {m: frames[m] / seconds[m] for m in frames}
                results.append(
                    {
                        "collector": cls_name,
                        "payload": label,
                        "explicit": send_copy,
                        "scheme": kind,
                        "cycle_never_p50": p50(cycles["never"]),
                        "update_p50": p50(updates),
                        "fps_never": fps["never"],
                        "fps_every_batch": fps["every_batch"],
                        "loss": 1 - fps["every_batch"] / fps["never"],
                        "loss_median_cycle": 1 - p50(cycles["never"]) / p50(cycles["every_batch"]),
                    }
                )
                print(f"  fps {cls_name} {label} {kind}: {fps}", file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions: under a minute")
    parser.add_argument("--out", default="benchmarks/results/sync_bench.json", help="where to write the JSON")
    parser.add_argument(
        "--docs", action="store_true", help="also write the tables into the docs (docs/results/sync_bench.md)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    quick = args.quick
    all_sizes = SIZES
    upd_sizes = {k: SIZES[k] for k in (["1MB", "16MB"] if quick else SIZES)}
    kinds = ["shmsync", "SharedMem"] if quick else ["shmsync", PRIVATE, "SharedMem", "MultiProcess"]
    started = time.perf_counter()
    report: dict = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "memory_gb": round(psutil.virtual_memory().total / 2**30),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "quick": quick,
    }
    import tensordict
    import torchrl

    report["machine"].update(torchrl=torchrl.__version__, tensordict=tensordict.__version__)

    print("publish ...", file=sys.stderr, flush=True)
    report["publish"] = bench_publish(all_sizes if not quick else {k: SIZES[k] for k in ("4KB", "16MB")}, quick)
    report["parallel"] = bench_parallel_publish(
        {k: SIZES[k] for k in (["16MB"] if quick else ["16MB", "128MB"])}, quick
    )
    report["background"] = bench_background(100 << 20, 10 if quick else 30)
    report["reader_table"] = bench_reader_table(quick)
    print("reader ...", file=sys.stderr, flush=True)
    report["reader"] = bench_reader(all_sizes if not quick else {"16MB": SIZES["16MB"]}, quick)
    print("update_policy_weights_ with 2 workers ...", file=sys.stderr, flush=True)
    # The first collector of a process leaves process-wide shared memory behind (multiprocessing
    # and torch bookkeeping, ~20-100 KiB) that later ones reuse: start and stop one unmeasured, so
    # "left after shutdown" counts only what each scheme leaves.
    collector, _ = build_collector("SharedMem", SIZES["4KB"], 2)
    next(iter(collector))
    collector.shutdown()
    del collector
    gc.collect()
    report["update"] = bench_update(upd_sizes, kinds, 2, quick)
    print("update in a real loop ...", file=sys.stderr, flush=True)
    report["real_loop"] = bench_real_loop(SIZES["1MB"], ["shmsync", "SharedMem"], 20 if quick else 100)
    print("slow reader ...", file=sys.stderr, flush=True)
    report["slow_reader"] = bench_slow_reader(64 << 20 if quick else 256 << 20, 6.0 if quick else 16.0)
    print("throughput ...", file=sys.stderr, flush=True)
    report["throughput"] = bench_throughput(
        {"1MB": SIZES["1MB"]} if quick else {"1MB": SIZES["1MB"], "16MB": SIZES["16MB"]},
        ["shmsync", ONE_THREAD, PRIVATE, "SharedMem"],
        ["MultiSyncCollector"] if quick else ["MultiSyncCollector", "MultiAsyncCollector"],
        batches=10 if quick else 60,
        explicit=() if quick else ("16MB",),
    )
    if not quick:
        print("scaling ...", file=sys.stderr, flush=True)
        report["scaling"] = []
        for w in (1, 2, 4):
            report["scaling"] += bench_update({"16MB": SIZES["16MB"]}, ["shmsync", "SharedMem"], w, quick)
    report["seconds"] = time.perf_counter() - started

    text = render(report)
    print(text)
    if args.docs:
        write_docs_page(Path(__file__).resolve().parents[1] / "docs/results/sync_bench.md", text, MEASURES)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nJSON written to {out} ({report['seconds']:.0f}s)")
    return 0


def write_docs_page(path: Path, text: str, measures: list[str]) -> None:
    """The tables as a page of the docs, with where they came from (benchmarks/provenance.py)."""
    from provenance import write

    write(path.stem, f"Each table's numbers come from one run.\n\n```text\n{text}\n```", measures)
    print(f"docs page written to {path}", file=sys.stderr)


def _update_row(label: str, by_scheme: dict, field: str) -> list[str]:
    """One row of the update table: p50 / p95 per scheme, then TorchRL's schemes over shmsync."""
    ours = by_scheme.get("shmsync")
    row = [label if field == "update" else f"{label}, explicit"]
    for kind in ("shmsync", "SharedMem", "MultiProcess"):
        x = by_scheme.get(kind)
        row.append(f"{fmt_t(p50(x[field]))} / {fmt_t(p95(x[field]))}" if x else "-")
    for kind in ("SharedMem", "MultiProcess"):
        x = by_scheme.get(kind)
        row.append(f"{p50(x[field]) / p50(ours[field]):.1f}x" if x and ours else "-")
    floor = ours.get("copy_floor") if ours else None
    shared = by_scheme.get("SharedMem")
    if floor and shared and field == "update_explicit":
        row.append(f"{fmt_t(p50(floor))} (SharedMem / floor {p50(shared[field]) / p50(floor):.1f}x)")
    else:
        row.append(fmt_t(p50(floor)) if floor else "-")
    return row


def render(r: dict) -> str:
    m = r["machine"]
    parts = [
        f"# shmsync benchmark: {m['cores']} cores, {m['memory_gb']} GB, Python {m['python']}, torch {m['torch']}, "
        f"torchrl {m['torchrl']}, tensordict {m['tensordict']}, {m['torch_threads']} torch thread"
    ]
    rows = []
    for x in r["publish"]:
        pub = p50(x["publish"])
        rows.append(
            [
                x["payload"],
                fmt_t(p50(x["copy_warm"])),
                fmt_t(p50(x["copy_2_alternating"])),
                fmt_t(p50(x["copy_3_rotating_shm"])),
                fmt_t(p50(x["copy_same_slots"])),
                f"{fmt_t(pub)} / {fmt_t(p95(x['publish']))}",
                f"{pub / p50(x['copy_2_alternating']):.2f}x",
                f"{pub / p50(x['copy_same_slots']):.2f}x",
                fmt_t(pub - p50(x["copy_same_slots"])),
            ]
        )
    parts.append(
        table(
            "Trainer side: publish() against a plain copy_ of the same tensors (p50; publish p50 / p95)",
            [
                "payload",
                "copy_ warm dst",
                "copy_ 2 alternating dsts",
                "copy_ 3 rotating shm dsts",
                "copy_ into publish's slots",
                "publish p50 / p95",
                "vs alternating",
                "vs same slots",
                "publish - same-slot copy",
            ],
            rows,
        )
        + "\npublish writes its 3 shared-memory slots in turn; the like-for-like floor is a plain copy_ into those"
        "\nvery slots in turn (other allocations of the same size copy up to ~20% faster or slower here, by"
        "\nphysical placement). At 16 MB one warm destination stays in the 32 MB L3 cache; 2 or 3 do not."
    )
    if "background" in r:
        b = r["background"]
        bg, cp = p50(b["background_publish"]), p50(b["copy"])
        parts.append(
            table(
                "Trainer side: publish() with the opt-in unsafe_background_copy=True (p50)",
                ["payload", "one plain copy_", "publish() on the trainer's thread", "vs the copy"],
                [[fmt_b(b["bytes"]), fmt_t(cp), fmt_t(bg), f"{bg / cp:.3f}x"]],
            )
            + "\nThe copy runs on the store's copier thread and reads the live weights after publish() returns:"
            "\nthe opt-in gives up the snapshot (the default copies before returning)."
        )
    if r.get("parallel"):
        rows = []
        for x in r["parallel"]:
            n = x["threads"]
            c1, cn = p50(x["copy_1_thread"]), p50(x[f"copy_{n}_threads"])
            p1, pn = p50(x["publish_1_thread"]), p50(x[f"publish_{n}_threads"])
            rows.append(
                [x["payload"], fmt_t(c1), fmt_t(cn), fmt_t(p1), fmt_t(pn), f"{p1 / pn:.2f}x", f"{pn / cn:.2f}x"]
            )
        parts.append(
            table(
                f"Trainer side: publish() copying on 1 thread and on {r['parallel'][0]['threads']} (the default here), "
                "against plain copy_ into the same slots (p50)",
                [
                    "payload",
                    "copy_ 1 thread",
                    "copy_ N threads",
                    "publish 1 thread",
                    "publish N threads",
                    "publish 1 / N",
                    "publish N / copy N",
                ],
                rows,
            )
            + "\nTorchRL keeps the trainer at one torch thread; publish splits a copy of 4 MB or more across the"
            "\ncores it may run on (SHMSYNC_COPY_THREADS fixes the count), which sit idle during a synchronous update."
        )
    if r.get("real_loop"):
        by = {x["scheme"]: x for x in r["real_loop"]}
        ours, theirs = by.get("shmsync"), by.get("SharedMem")
        line = (
            "\nIn a real loop (1 MB, a batch collected before each call, no warming write), "
            "update_policy_weights_(w) p50:"
        )
        if ours:
            up, fl = p50(ours["update"]), p50(ours["copy_floor"])
            line += f" shmsync {fmt_t(up)}, plain copy_ of the same bytes {fmt_t(fl)} ({up / fl:.2f}x)"
            if ours.get("publish"):
                line += f", store.publish() alone {fmt_t(p50(ours['publish']))}"
        if ours and theirs:
            theirs_up = p50(theirs["update"])
            line += f", SharedMem {fmt_t(theirs_up)} ({theirs_up / p50(ours['update']):.1f}x shmsync)"
        parts.append(line)
    if r.get("slow_reader"):
        rows = [
            [
                x["mode"],
                fmt_b(x["bytes"]),
                f"{x['loads_per_min']:.0f}",
                f"{x['failed_copies_per_load']:.2f}",
                f"{100 * x['pinned_share']:.0f}%",
                f"{x['one_copy_per_load_per_min']:.0f}",
            ]
            for x in r["slow_reader"]
        ]
        by = {x["mode"]: x for x in r["slow_reader"]}
        ours, old = by.get("pin first when outpaced"), by.get("optimistic first")
        gain = f" ({ours['loads_per_min'] / max(old['loads_per_min'], 1e-9):.1f}x the loads)" if ours and old else ""
        parts.append(
            table(
                f"A slow reader (niced, beside a busy process) while the writer publishes back to back{gain}",
                ["reader", "store", "loads per minute", "failed copies per load", "pinned loads", "ceiling"],
                rows,
            )
            + "\nceiling: loads per minute if every load took one plain copy, timed by this reader in the same"
            "\nconditions right after its run (the writer still publishing, the busy process still running)."
        )
    rt = r.get("reader_table")
    if rt:
        few, many = p50(rt["publish_2_readers"]), p50(rt["publish_1000_readers"])
        parts.append(
            f"\npublish() at 4 KB with 1,000 readers listed: {fmt_t(many)} against {fmt_t(few)} with 2 "
            f"({many / few:.2f}x)"
        )
    rd = r["reader"]
    rows = [
        [
            x["payload"],
            fmt_t(p50(x["copy_floor"])),
            fmt_t(p50(x["reload"])),
            f"{p50(x['reload']) / p50(x['copy_floor']):.2f}x",
            fmt_t(p50(x["zero_copy_reload"])),
        ]
        for x in rd["reload"]
    ]
    parts.append(
        table(
            f"Worker side: version check with nothing new {rd['version_check_s'] * 1e9:.0f} ns; reload against copy_",
            ["payload", "copy_ from shared memory", "reload p50", "ratio", "in-place reload p50"],
            rows,
        )
        + "\nthe floor copies the same tensors out of the same slot, one plain copy_ each; a reload in place"
        "\nleases the slot and points the parameters at it (the default for CPU workers; reload: zero_copy=False)."
    )
    by = {}
    for x in r["update"]:
        by.setdefault(x["payload"], {})[x["scheme"]] = x
    rows = [_update_row(label, d, field) for field in ("update", "update_explicit") for label, d in by.items()]
    parts.append(
        table(
            "Trainer side with 2 workers: collector.update_policy_weights_() p50 / p95 "
            "(plain: the collector's own policy; explicit: a TensorDict of the trainer's separate copy)",
            [
                "payload",
                "shmsync",
                "SharedMem",
                "MultiProcess",
                "SharedMem/shmsync",
                "MultiProcess/shmsync",
                "copy floor",
            ],
            rows,
        )
        + "\nEach timed call follows an untimed in-place write of the weights it sends, as after an optimizer step."
        "\ncopy floor: one plain copy_ of the same tensors into the same shared-memory slots, timed in the"
        "\nsame loop; (SharedMem explicit / copy floor) is the most any design that copies the weights once can gain."
    )
    rows = []
    for x in r["update"]:
        rows.append(
            [
                x["payload"],
                x["scheme"],
                fmt_b(x["shm_bytes"]),
                fmt_b(x["uss_bytes"]),
                fmt_b(x["shm_left_after_shutdown"]),
            ]
        )
    parts.append(
        table(
            "Memory with 2 workers (shared memory in use, summed USS of main + workers, both as growth; "
            "shared memory left after shutdown)",
            ["payload", "scheme", "shared memory", "USS", "left after shutdown"],
            rows,
        )
    )
    # What copying the weights once on the trainer and once in a worker costs, against a cycle.
    copy_out = {x["payload"]: p50(x["copy_same_slots"]) for x in r["publish"]}
    copy_in = {x["payload"]: p50(x["copy_floor"]) for x in rd["reload"]}
    rows = []
    for x in r["throughput"]:
        label = x["payload"]
        floor = "-"
        if x["scheme"].startswith("shmsync") and label in copy_out and label in copy_in:
            copies = copy_out[label] + (copy_in[label] if x["scheme"] == PRIVATE else 0)
            floor = f"{100 * copies / x['cycle_never_p50']:.1f}%"
        rows.append(
            [
                x["collector"],
                f"{label}, explicit" if x.get("explicit") else label,
                x["scheme"],
                f"{x['fps_never']:.0f}",
                f"{x['fps_every_batch']:.0f}",
                f"{100 * x['loss']:.1f}%",
                f"{100 * x['loss_median_cycle']:.1f}%",
                f"{100 * x['update_p50'] / x['cycle_never_p50']:.1f}%",
                floor,
            ]
        )
    parts.append(
        table(
            "Collection throughput with 2 workers (frames/s): never publishing against publishing after every batch",
            [
                "collector",
                "payload",
                "scheme",
                "never",
                "every batch",
                "lost",
                "lost (median cycle)",
                "update call",
                "copy floor",
            ],
            rows,
        )
        + "\nupdate call: the update_policy_weights_() call itself (p50), as a share of the median cycle without"
        "\npublishing; copy floor: one copy into shared memory (trainer, warm source) plus one out of it (worker;"
        "\nnone in place), as the same share. SharedMem's plain update copies nothing (its"
        "\nworkers alias the trainer's weights): a design that never lets workers see half-written weights"
        "\nmust copy at least once per publish."
    )
    if r.get("scaling"):
        rows = []
        for x in r["scaling"]:
            rows.append([x["workers"], x["scheme"], f"{fmt_t(p50(x['update']))} / {fmt_t(p95(x['update']))}"])
        parts.append(
            table("Scaling at 16 MB: update_policy_weights_() p50 / p95", ["workers", "scheme", "update"], rows)
        )
    return "\n".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
