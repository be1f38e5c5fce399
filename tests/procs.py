"""Child-process entry points for the tests (spawn needs them importable)."""

from __future__ import annotations

import os
import signal
import time

import torch
from tensordict import TensorDict
from torch import nn

from shmsync import WeightReader, WeightStore, WriterBusyError

STRESS_SIZES = {"a": 2_000_000, "b": 1_000_000, "c": 1_000_000, "d": 17}  # ~16 MB of float32


class Blob(nn.Module):
    """A module whose buffers match :func:`blob_weights` (for stress tests)."""

    def __init__(self, sizes: dict[str, int], dtype=torch.float32):
        super().__init__()
        for k, n in sizes.items():
            self.register_buffer(k, torch.zeros(n, dtype=dtype))


class ParamBlob(nn.Module):
    """Like :class:`Blob`, with parameters (what a zero-copy reader points at shared memory)."""

    def __init__(self, sizes: dict[str, int]):
        super().__init__()
        for k, n in sizes.items():
            self.register_parameter(k, nn.Parameter(torch.zeros(n)))


def blob_weights(sizes: dict[str, int], value: float = 0.0) -> TensorDict:
    return TensorDict({k: torch.full((n,), float(value)) for k, n in sizes.items()})


def set_all(td: TensorDict, value: float) -> None:
    for t in td.values():
        t.fill_(value)


def mixed_values(module: nn.Module) -> set[float]:
    """Distinct values across all parameters and buffers (one value means one consistent version)."""
    vals = set()
    for b in (*module.parameters(), *module.buffers()):
        lo, hi = torch.aminmax(b.detach())
        vals.update({float(lo), float(hi)})
    return vals


def attach_and_follow(store_or_name, sizes, want_versions: int, conn) -> None:
    """Attach (by name or pickled store), report each version loaded until ``want_versions``."""
    store = WeightStore.attach(store_or_name) if isinstance(store_or_name, str) else store_or_name
    module = Blob(sizes)
    reader = WeightReader(store, module)
    seen = []
    conn.send(("ready", os.getpid()))
    while reader.version < want_versions:
        if reader.poll():
            values = mixed_values(module)
            seen.append((reader.version, sorted(values)))
        else:
            time.sleep(0.0002)
    conn.send(("seen", seen))
    store.close()


def stress_reader(store: WeightStore, sizes, min_reloads: int, conn) -> None:
    """Poll as fast as possible; count reloads whose buffers hold more than one value."""
    torch.set_num_threads(1)
    module = Blob(sizes)
    reader = WeightReader(store, module)
    reloads = mixed = wrong_tag = 0
    conn.send(("ready", os.getpid()))
    while reloads < min_reloads:
        if reader.poll():
            reloads += 1
            values = mixed_values(module)
            if len(values) != 1:
                mixed += 1
            elif values != {float(reader.version)}:
                wrong_tag += 1
    conn.send(("done", reloads, mixed, wrong_tag, store.retries, store.pinned_reads))
    store.close()


def zero_copy_reader(store: WeightStore, sizes, min_reloads: int, hold: float, conn) -> None:
    """Reload with ``zero_copy``; check each version is whole, then that it stays unchanged for
    ``hold`` seconds while the writer keeps publishing (its slot is leased)."""
    torch.set_num_threads(1)
    module = ParamBlob(sizes)
    reader = WeightReader(store, module, zero_copy=True)
    reloads = mixed = wrong_tag = changed = viewed = 0
    conn.send(("ready", os.getpid()))
    while reloads < min_reloads:
        if not reader.poll():
            time.sleep(0.0002)  # leave the CPU to the writer and to other tests' processes
            continue
        reloads += 1
        viewed += reader.viewing
        values = mixed_values(module)
        if len(values) != 1:
            mixed += 1
        elif values != {float(reader.version)}:
            wrong_tag += 1
        time.sleep(hold)
        if mixed_values(module) != values:
            changed += 1
    conn.send(("done", reloads, mixed, wrong_tag, changed, viewed))
    store.close()


def lease_and_hang(store: WeightStore, sizes, conn) -> None:
    """Load with ``zero_copy`` (leasing the latest slot), then wait to be killed."""
    reader = WeightReader(store, ParamBlob(sizes), zero_copy=True)
    reader.poll()
    conn.send(("leased", reader.viewing, reader.version))
    time.sleep(3600)


def write_through_view(store: WeightStore, sizes, conn) -> None:
    """Load with ``zero_copy``, then write a parameter in place: the process must fault."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    module = ParamBlob(sizes)
    reader = WeightReader(store, module, zero_copy=True)
    reader.poll()
    conn.send(("viewing", reader.viewing))
    with torch.no_grad():
        next(module.parameters()).add_(1.0)
    conn.send(("wrote",))


def writer(store_name: str, sizes, count: int, conn, every_value: bool = True) -> None:
    """Publish ``count`` versions back to back, each tensor filled with its version number."""
    torch.set_num_threads(1)
    store = WeightStore.attach(store_name)
    weights = blob_weights(sizes)
    conn.send(("ready", os.getpid()))
    start = time.perf_counter()
    slowest = 0.0
    try:
        for _ in range(count):
            set_all(weights, store.version + 1)
            began = time.perf_counter()
            store.publish(weights)
            slowest = max(slowest, time.perf_counter() - began)
            if conn.poll():
                break  # the parent says stop
    except WriterBusyError as e:
        conn.send(("busy", str(e)))
        return
    conn.send(("done", store.version, time.perf_counter() - start, slowest))
    store.close()


def stuck_reader(store: WeightStore, how: str, conn) -> None:
    """Enter a pinned reload and stop in the middle of the copy (the parent then kills or stops us)."""

    def copy(slot):
        conn.send(("in-copy", os.getpid()))
        if how == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)

    store.memory.protocol.read_pinned(copy, time.monotonic() + 3600)


def slow_reader(store: WeightStore, sizes, loads: int, delay: float, conn) -> None:
    """Reload with a copy slowed by ``delay`` s: slower than several publishes of the writer."""
    torch.set_num_threads(1)
    module = Blob(sizes)
    targets = list(module.buffers())
    names = [n for n, _ in module.named_buffers()]
    order = sorted(range(len(names)), key=lambda i: names[i])
    targets = [targets[i] for i in order]
    done, bad = 0, 0
    conn.send(("ready", os.getpid()))
    start = time.monotonic()
    while done < loads:

        def copy(slot):
            for t, v in zip(targets, store.memory.slots[slot]):
                t.copy_(v)
                time.sleep(delay)

        version = store.memory.protocol.read(copy, timeout=60)
        done += 1
        if mixed_values(module) != {float(version)}:
            bad += 1
    conn.send(("done", done, bad, store.retries, store.pinned_reads, time.monotonic() - start))
    store.close()


def create_and_hang(sizes, conn) -> None:
    """Create a store (this process is its creator) and wait to be killed."""
    store = WeightStore.create(blob_weights(sizes, 1.0))
    conn.send(("created", store.name))
    time.sleep(3600)


def pool_parent(conn) -> None:
    """A trainer that launches two workers, then waits to be killed (its workers must follow)."""
    from shmsync.workers.launch import launch
    from shmsync.workers.policies import make_env, mlp_policy

    store = WeightStore.create(mlp_policy(make_env("CartPole-v1")))
    pool = launch(store.name, 2, "CartPole-v1", frames_per_batch=50)
    next(pool.batches(1))
    conn.send(("running", store.name, pool.pids))
    time.sleep(3600)


def _watching_child(parent: int, conn) -> None:
    from shmsync import exit_with_parent

    exit_with_parent(parent)  # explicit: the parent may be gone before this line runs
    conn.send(("watching", os.getpid()))
    time.sleep(3600)


def parent_of_a_watching_child(conn) -> None:
    """Starts a child that calls exit_with_parent() and tells ``conn`` it watches, then waits to
    be killed (the child must follow)."""
    import multiprocessing as mp

    child = mp.get_context("spawn").Process(target=_watching_child, args=(os.getpid(), conn), daemon=False)
    child.start()
    time.sleep(3600)
