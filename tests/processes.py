"""What the tests' child processes run against a store: readers and writers that report what they
saw, and processes that hang, stop or die on purpose mid-publish or mid-read. Module-level, so
that a spawned or forked child imports them by name."""

from __future__ import annotations

import os
import signal
import time

import torch

from shmsync import SharedWeightsWrittenError, WeightReader, WeightStore, WriterBusyError
from shmsync.testing import read_with, stop_mid_publish
from tests.weights import Blob, ParamBlob, blob_weights, mixed_values, set_all


def use_store_dir(path: str) -> None:
    """Make this process look for stores in ``path`` (a test's own ``SHMSYNC_DIR``)."""
    from shmsync.core import segment

    segment.SHM_DIR = str(path)


def hold_store(store_dir: str, name: str, zero_copy: bool, conn) -> None:
    """Attach to ``name`` in ``store_dir`` and load it (``zero_copy``: leasing its latest slot);
    report ``("holding", viewing, version)``, then wait to be killed."""
    use_store_dir(store_dir)
    import torch

    from shmsync import WeightReader, WeightStore

    store = WeightStore.attach(name)
    reader = WeightReader(store, torch.nn.Linear(64, 64), zero_copy=zero_copy)
    reader.poll()
    conn.send(("holding", reader.viewing, reader.version))
    time.sleep(3600)


def create_in_dir_and_hang(store_dir: str, name: str, conn) -> None:
    """Create store ``name`` in ``store_dir`` (this process its creator), then wait to be killed."""
    use_store_dir(store_dir)
    import torch

    from shmsync import WeightStore

    WeightStore.create(torch.nn.Linear(64, 64), name=name, unlink_at_exit=False)
    conn.send(("created",))
    time.sleep(3600)


def canary(conn) -> None:
    """A process that records every catchable signal it gets; answers "report" with the list."""
    import signal

    received = []
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            try:
                signal.signal(sig, lambda s, _frame: received.append(int(s)))
            except (OSError, ValueError):
                pass
    conn.send(("ready", os.getpid()))
    while True:
        if conn.poll(0.05) and conn.recv() == "report":
            conn.send(("received", received))


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
    conn.send(("done", reloads, mixed, wrong_tag, store.slot_reader.retries, store.slot_reader.pinned_reads))
    store.close()


def in_place_reader(store: WeightStore, sizes, min_reloads: int, hold: float, conn) -> None:
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
    """Load in place, write the parameters (``a`` in place, ``b`` through ``.data``), then, once
    the parent published, reload twice: what the module holds at each step."""
    module = ParamBlob(sizes)
    reader = WeightReader(store, module)
    reader.poll()
    with torch.no_grad():
        module.a.add_(1.0)
    module.b.data.fill_(-1.0)
    conn.send(("wrote", reader.viewing, float(module.a.min()), float(module.b.max())))
    conn.recv()
    try:
        reader.poll()
        conn.send(("reloaded",))
    except SharedWeightsWrittenError as e:
        conn.send(("refused", str(e), mixed_values(module)))
    reader.poll()
    conn.send(("then", reader.version, reader.viewing, mixed_values(module)))


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
    version = store.flush()  # its give-backs too: no slot is left marked being written
    conn.send(("done", version, time.perf_counter() - start, slowest))
    store.close()


def writer_killed_mid_copy(store_name: str, sizes, publishes: int, conn) -> None:
    """Publish ``publishes`` versions, then start one more and stop halfway through its copy
    (half the tensors written, the slot marked being written); say so and wait to be killed."""
    torch.set_num_threads(1)
    store = WeightStore.attach(store_name)
    weights = blob_weights(sizes)
    for _ in range(publishes):
        set_all(weights, store.version + 1)
        store.publish(weights)
    slot = stop_mid_publish(store)  # what publish() does, stopped in the middle
    conn.send(("mid-copy", store.version, slot))
    time.sleep(3600)


def promise_and_stop_mid_copy(sizes, conn) -> None:
    """Create a store (``unsafe_background_copy``), then publish version 1 and stall its background
    copy halfway: the version is promised and never lands. Say so and wait to be killed."""
    import threading

    from shmsync.writer import background as store_module

    torch.set_num_threads(1)
    weights = blob_weights(sizes, 0.0)
    store = WeightStore.create(weights, unsafe_background_copy=True)
    copying = threading.Event()

    def stalled_copy(dst, src, on_cpu=None, threads=None):
        for d, s in zip(dst[: len(dst) // 2], src):
            d.copy_(s)
        copying.set()
        time.sleep(3600)

    store_module.copy_all = stalled_copy
    set_all(weights, 1.0)
    store.publish(weights)
    copying.wait(30)
    conn.send(("mid-copy", store.name, store.info()["promised"]))
    time.sleep(3600)


def wait_for_the_promise(store_name: str, sizes, conn) -> None:
    """Attach, load, then on the parent's word wait for the promised version; report what was
    loaded and when the wait ended (``time.monotonic()``: one clock for every process)."""
    store = WeightStore.attach(store_name)
    module = ParamBlob(sizes)
    reader = WeightReader(store, module)
    reader.poll()
    conn.send(("ready", reader.version))
    conn.recv()
    try:
        reader.poll_promised(timeout=30)
    except Exception as e:  # the parent asserts on it
        conn.send(("went on", reader.version, time.monotonic(), repr(e)))
    else:
        conn.send(("went on", reader.version, time.monotonic(), None))
    conn.send(("loaded", sorted(mixed_values(module))))
    store.close()


def stuck_reader(store: WeightStore, how: str, conn) -> None:
    """Enter a pinned reload and stop in the middle of the copy (the parent then kills or stops us)."""

    def copy(slot, views):
        conn.send(("in-copy", os.getpid()))
        if how == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)

    read_with(store, copy, pinned=True, timeout=3600)


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

        def copy(slot, views):
            for t, v in zip(targets, views):
                t.copy_(v)
                time.sleep(delay)

        version = read_with(store, copy)
        done += 1
        if mixed_values(module) != {float(version)}:
            bad += 1
    conn.send(("done", done, bad, store.slot_reader.retries, store.slot_reader.pinned_reads, time.monotonic() - start))
    store.close()


def create_and_hang(sizes, conn) -> None:
    """Create a store (this process is its creator) and wait to be killed."""
    store = WeightStore.create(blob_weights(sizes, 1.0))
    conn.send(("created", store.name))
    time.sleep(3600)


def poll_in_place(store: WeightStore, sizes, conn) -> None:
    """Run on the store's memory in place, polling every millisecond until killed."""
    module = ParamBlob(sizes)
    reader = WeightReader(store, module)
    reader.poll()
    conn.send(("loaded", reader.viewing, reader.version))
    while True:
        reader.poll()
        time.sleep(0.001)


def follow_copying(store: WeightStore, sizes, want_version: int, write_after: int, tracking: bool, conn) -> None:
    """Follow ``store`` with a private copy (``tracking``: proving the tensors it does not copy by
    the pages written, else by comparison), telling each version loaded (``("loaded",)``), until
    ``want_version``; after loading ``write_after``, write the module's ``backbone`` through ``.data``.
    Report ``("seen", [(version, {name: value}, bytes copied), ...], proof)``; a tensor that holds
    more than one value reports None."""
    if not tracking:
        os.environ["SHMSYNC_WRITE_TRACKING"] = "0"
    module = ParamBlob(sizes)
    reader = WeightReader(store, module, zero_copy=False)
    seen = []
    conn.send(("ready",))
    while reader.version < want_version:
        if not reader.poll():
            time.sleep(0.0005)
            continue
        values = {}
        for name, t in module.named_parameters():
            low, high = torch.aminmax(t.detach())
            values[name] = float(low) if float(low) == float(high) else None
        seen.append((reader.version, values, reader.copied_bytes))
        if reader.version == write_after:
            module.backbone.data[123] = -1.0  # its own process: the next reload copies it back
        conn.send(("loaded",))
    conn.send(("seen", seen, reader.unchanged_proof))
    store.close()
