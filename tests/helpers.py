"""Helpers shared by the tests: waiting, commands, weights for stress tests, and the entry points
of child processes and small real TorchRL set-ups (module-level, so spawned children and
TorchRL's workers can import them). TorchRL is imported inside the functions that need it, so
the core tests never load it."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time

import torch
from tensordict import TensorDict
from torch import nn

from shmsync import SharedWeightsWrittenError, WeightReader, WeightStore, WriterBusyError
from shmsync.testing import read_with, stop_mid_publish


# -- waiting, descriptors, commands ----------------------------------------------------------
def open_fds(under=None) -> set[int]:
    """This process's open file descriptors; with ``under``, only those open on a file in that
    folder (all a test can answer for: threads that earlier tests left in the same process, a
    relay's or Ray's, open and close descriptors of their own meanwhile)."""
    folder = None if under is None else f"{os.path.realpath(under)}{os.sep}"
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        if folder is not None:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # closed meanwhile, or listdir's own
                continue
            if not target.startswith(folder):
                continue
        fds.add(int(fd))
    return fds


def wait_for(condition, timeout: float = 30.0, what: str = "condition") -> None:
    """Return once ``condition()`` is true; AssertionError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def cli(*args: str, env: dict | None = None, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``python -m shmsync ARGS``; its result (asserting exit 0 with ``check``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "shmsync", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def run_script(*args: str, timeout: float = 240) -> str:
    """Run ``python ARGS`` from the repository's root, unbuffered; its output (asserting exit 0)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def use_store_dir(path: str) -> None:
    """Make this process look for stores in ``path`` (a test's own ``SHMSYNC_DIR``)."""
    from shmsync.core import segment

    segment.SHM_DIR = path


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


# -- weights and processes of the store tests ----------------------------------------------------
SMALL = {"a": 1000, "b": 300, "c": 7}
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


def fill(module: nn.Module, value: float) -> None:
    """Every parameter of ``module`` set to ``value`` in place."""
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(value)


# QValueActor's one-hot action when both Q-values are equal (all its weights zero).
TIE = torch.tensor([1, 1])


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
    conn.send(("done", reloads, mixed, wrong_tag, store.reader.retries, store.reader.pinned_reads))
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

    from shmsync.writer import store as store_module

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
    conn.send(("done", done, bad, store.reader.retries, store.reader.pinned_reads, time.monotonic() - start))
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


# -- processes of the relay tests: each "host" a process with a store folder of its own ----------------
SECRET = "the relay tests' secret, 32 bytes"


def run_relay(host_dir: str, port: int, name: str, max_versions, precreate, conn) -> None:
    """A relay for host ``host_dir``; reports ("done", versions received, store version) or the error."""
    use_store_dir(host_dir)
    from shmsync import WeightStore
    from shmsync.relay import Relay

    existing = None
    if precreate is not None:  # this host's store, built here from another model
        existing = WeightStore.create(blob_weights(precreate, 5.0), name=name)
        existing.release_writer()
    relay = Relay("127.0.0.1", port, store=name, secret=SECRET, timeout=30)
    conn.send(("started",))
    try:
        relay.run(max_versions)
        conn.send(("done", relay.received, relay.store.version))
    except Exception as e:
        version = existing.version if existing is not None else None
        values = sorted({float(t.flatten()[0]) for t in existing.snapshot().weights.values()}) if existing else None
        conn.send(("error", type(e).__name__, str(e), version, values))
    finally:
        relay.close()
        if existing is not None:
            existing.close()


def tree_relay(host_dir: str, port: int, name: str, conn) -> None:
    """A relay of a tree for host ``host_dir``. Reports ("attached", parent address, its own serving
    address) each time it (re-)attaches, and on "report": ("versions", every version published on
    its host, each with whether its weights were whole), then ("done", ...) or ("error", ...) when
    ``run`` ends. Each published version's weights are checked right as it commits."""
    import threading

    use_store_dir(host_dir)
    from shmsync.relay import Relay

    relay = Relay("127.0.0.1", port, store=name, secret=SECRET, timeout=30)
    published = []  # (version, whole)
    reported = [0]
    lock = threading.Lock()

    def say(*message):
        with lock:
            conn.send(message)

    def on_publish(version):
        values = {float(t.flatten()[0]) for t in relay.store.snapshot().weights.values()}
        values |= {float(t.flatten()[-1]) for t in relay.store.snapshot().weights.values()}
        published.append((version, values == {float(version)}))

    def watch():
        listening = None
        while True:
            if relay.attachments != reported[0]:
                reported[0] = relay.attachments
                say("attached", relay.parent, relay.serving)
            if relay.store is not None and listening is not relay.store:
                listening = relay.store
                published.append((relay.store.version, True))  # the first version made the store
                relay.store.writer.add_listener(on_publish)
            if conn.poll(0.02) and conn.recv() == "report":
                say("versions", list(published))

    threading.Thread(target=watch, daemon=True).start()
    try:
        relay.run()
        say("done", relay.received, relay.store.version if relay.store else None)
    except Exception as e:
        say("error", type(e).__name__, str(e))
    finally:
        relay.close()


def flood(port: int, n: int, conn) -> None:
    """Connections to a relay server that never finish a handshake: ``n`` kept open, half of them
    silent and half cut off in the middle of their hello, each one the server cuts replaced at
    once (a reconnect loop). Reports ("flooding",) once ``n`` were opened; runs until killed. It
    waits for the server's cuts rather than polling, so that it takes no more of this machine's
    cores than an attacker on another host would."""
    import resource
    import selectors
    import socket

    from shmsync.relay import wire

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * n + 64)), hard))
    selector = selectors.DefaultSelector()

    def connect(i):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        if i % 2:
            sock.sendall(wire.MAGIC + os.urandom(20))  # a hello that stops halfway
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ, i)

    for i in range(n):
        connect(i)
    conn.send(("flooding",))
    while True:
        for key, _ in selector.select(1.0):
            sock = key.fileobj
            try:
                data = sock.recv(4096)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data == b"":  # cut: another takes its place at once
                selector.unregister(sock)
                sock.close()
                try:
                    connect(key.data)
                except OSError:
                    time.sleep(0.01)


def trickle(port: int, n: int, conn) -> None:
    """A slowloris that trickles: ``n`` connections, each sending one byte of a hello at once and
    another every 0.3 s (so none is ever silent, none ever finishes), a new one every 10 ms, and
    each the server cuts replaced. Reports ("flooding",) once ``n`` are open; runs until killed."""
    import heapq
    import resource
    import socket

    from shmsync.relay import wire

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 2 * n + 64)), hard))
    due = []  # (when, sequence, socket, bytes sent)

    def connect(now):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.send(wire.MAGIC[:1])
        except OSError:
            return
        sock.setblocking(False)
        heapq.heappush(due, (now + 0.3, id(sock), sock, 1))

    now = time.monotonic()
    for _ in range(n):
        connect(now)
    conn.send(("flooding",))
    next_new = time.monotonic()
    while True:
        now = time.monotonic()
        if now >= next_new:
            connect(now)
            next_new = now + 0.01
        while due and due[0][0] <= now:
            _, key, sock, sent = heapq.heappop(due)
            try:
                sock.send(wire.MAGIC[sent : sent + 1] or b"\0")
                heapq.heappush(due, (now + 0.3, key, sock, sent + 1))
            except OSError:  # cut: another takes its place
                sock.close()
                connect(now)
        time.sleep(max(0.0, min(next_new, due[0][0] if due else next_new) - time.monotonic()))


def join_and_stall(port: int, secret: str, n: int, conn) -> None:
    """``n`` relays that join the trainer at ``port``, answer HAVE -1, then never read a byte."""
    from shmsync.relay import wire

    links = []
    for _ in range(n):
        link = wire.connect("127.0.0.1", port, secret.encode(), 10)
        link.send_json(b"JOIN", {"node": os.urandom(8).hex(), "serve": None})
        link.recv_frame({b"LYOT": 64 << 20}, 10)
        link.recv_payload(10)
        link.recv_json({b"CONF": 4096}, 10)
        link.send_json(b"HAVE", {"version": -1})
        links.append(link)
    conn.send(("stalling",))
    time.sleep(3600)


def follow(host_dir: str, name: str, sizes, last: int, conn) -> None:
    """A reader on host ``host_dir``: loads every version it sees until ``last``; reports, per
    load, (version, distinct values in the weights)."""
    use_store_dir(host_dir)
    from shmsync import StoreNotFoundError, WeightReader, WeightStore

    deadline = time.monotonic() + 60
    while True:
        try:
            store = WeightStore.attach(name)
            break
        except StoreNotFoundError:
            if time.monotonic() > deadline:
                conn.send(("error", "no store"))
                return
            time.sleep(0.01)
    module = Blob(sizes)
    reader = WeightReader(store, module)
    reader.poll()  # the first load
    seen = [(reader.version, sorted(mixed_values(module)))]
    conn.send(("attached", seen[0][0]))
    while seen[-1][0] < last and time.monotonic() < deadline:
        if reader.poll():
            seen.append((reader.version, sorted(mixed_values(module))))
        else:
            time.sleep(0.001)
    conn.send(("seen", seen))
    reader.close()
    store.close()


def follow_as_worker(host_dir: str, name: str, sizes, worker: int, conn) -> None:
    """A reader on host ``host_dir`` as worker ``worker``: polls every 10 ms until killed; says
    ("attached", pid) once its store exists and it loaded."""
    use_store_dir(host_dir)
    from shmsync import StoreNotFoundError, WeightReader, WeightStore

    deadline = time.monotonic() + 60
    while True:
        try:
            store = WeightStore.attach(name)
            break
        except StoreNotFoundError:
            if time.monotonic() > deadline:
                conn.send(("error", "no store"))
                return
            time.sleep(0.01)
    reader = WeightReader(store, Blob(sizes), worker=worker)
    reader.poll()
    conn.send(("attached", os.getpid()))
    while True:
        reader.poll()
        time.sleep(0.01)


def trainer(sizes, conn) -> None:
    """A trainer with a RelaySender, publishing until killed."""
    from shmsync import WeightStore
    from shmsync.relay import RelaySender

    weights = blob_weights(sizes, 0.0)
    store = WeightStore.create(weights)
    sender = RelaySender(store, "127.0.0.1", 0, secret=SECRET)
    conn.send(("ready", store.name, sender.port))
    version = 0
    while True:
        time.sleep(0.01)
        version += 1
        set_all(weights, version)
        store.publish(weights)
        if sender.relays and version % 10 == 0:
            conn.send(("linked", version))
    del sender


def host_with_workers(host_dir: str, port: int, name: str, conn) -> None:
    """A host running `launch(..., relay=...)`: reports each batch's versions, then how it ended."""
    import os

    os.environ["SHMSYNC_DIR"] = host_dir  # for the relay and workers it spawns
    os.environ["SHMSYNC_RELAY_SECRET"] = SECRET
    use_store_dir(host_dir)
    from shmsync.workers.launch import launch

    with launch(name, 1, "CartPole-v1", relay=f"127.0.0.1:{port}", frames_per_batch=50) as pool:
        for _, batch in pool.batches():
            conn.send(("batch", sorted(set(batch["policy_version"].flatten().tolist()))))
        codes = pool.stop()
    conn.send(("ended", codes, pool.relay.exitcode))


# -- small real TorchRL set-ups ---------------------------------------------------------------------
def make_env():
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1")


def make_pendulum():
    from torchrl.envs import GymEnv

    return GymEnv("Pendulum-v1")


def make_policy(seed: int = 0):
    from torchrl.modules import MLP, QValueActor

    torch.manual_seed(seed)
    env_spec = make_env().action_spec
    return QValueActor(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"], spec=env_spec)


def make_trainer(collector, loss, total_frames: int, optim_steps_per_batch: int = 2):
    from torchrl.trainers import Trainer

    return Trainer(
        collector=collector,
        total_frames=total_frames,
        frame_skip=1,
        optim_steps_per_batch=optim_steps_per_batch,
        loss_module=loss,
        optimizer=torch.optim.Adam(loss.parameters(), 1e-3),
        progress_bar=False,
    )


def make_loss(policy):
    from torchrl.objectives import DQNLoss

    return DQNLoss(policy, action_space=make_env().action_spec, delay_value=False)


def make_normed_env():
    """CartPole whose observations pass through an ObservationNorm (a module with buffers)."""
    from torchrl.envs import ObservationNorm, TransformedEnv

    return TransformedEnv(make_env(), ObservationNorm(loc=torch.zeros(4), scale=torch.ones(4), in_keys=["observation"]))


class WeightProbe(torch.nn.Module):
    """A Pendulum policy that reports, per frame, the min and max over all of its weights.

    When every weight of a version is filled with that version's number, a frame produced by
    one complete version has ``lo == hi == version``; a mix of two versions cannot.
    """

    def __init__(self, big: int = 512):
        super().__init__()
        self.big = torch.nn.Parameter(torch.zeros(big, big))
        self.small = torch.nn.Parameter(torch.zeros(1000))

    def forward(self, observation):
        with torch.no_grad():
            lo = torch.minimum(self.big.min(), self.small.min())
            hi = torch.maximum(self.big.max(), self.small.max())
        batch = observation.shape[:-1]
        return torch.zeros(*batch, 1), lo.expand(batch).clone(), hi.expand(batch).clone()


def make_probe_policy(big: int = 512):
    """A :class:`WeightProbe` as a TorchRL policy; ``big``: the side of its square parameter."""
    from tensordict.nn import TensorDictModule

    return TensorDictModule(WeightProbe(big), in_keys=["observation"], out_keys=["action", "w_lo", "w_hi"])


def make_marked_env():
    """CartPole whose observations are shifted by +100, so a batch tells which worker made it."""
    from torchrl.envs import ObservationNorm, TransformedEnv

    return TransformedEnv(
        make_env(), ObservationNorm(loc=torch.full((4,), 100.0), scale=torch.ones(4), in_keys=["observation"])
    )


def make_marked_pendulum():
    """Pendulum whose observations are shifted by +100, so a batch tells which node made it."""
    from torchrl.envs import ObservationNorm, TransformedEnv

    return TransformedEnv(
        make_pendulum(), ObservationNorm(loc=torch.full((3,), 100.0), scale=torch.ones(3), in_keys=["observation"])
    )


def fork_collector_check() -> None:
    """Run in a fresh interpreter: a MultiSyncCollector with the fork start method."""
    import torch.multiprocessing as mp

    mp.set_start_method("fork", force=True)
    from torchrl.collectors import MultiSyncCollector

    from shmsync import ShmWeightSyncScheme

    policy = make_policy()
    scheme = ShmWeightSyncScheme()
    collector = MultiSyncCollector(
        [make_env] * 2, policy, frames_per_batch=40, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    try:
        it = iter(collector)
        assert (next(it)["policy_version"] == 0).all()
        with torch.no_grad():
            for p in policy.parameters():
                p.zero_()
        collector.update_policy_weights_()
        batch = next(it)
        assert (batch["policy_version"] == 1).all() and (batch["action"] == 1).all()
    finally:
        collector.shutdown()
    print("fork ok")


def make_linear_policy(bias: float = 0.0):
    """A Pendulum policy whose action is ``bias`` while its weight is zero: actions name the weights."""
    from tensordict.nn import TensorDictModule

    module = torch.nn.Linear(3, 1)
    with torch.no_grad():
        module.weight.zero_()
        module.bias.fill_(bias)
    return TensorDictModule(module, in_keys=["observation"], out_keys=["action"])


def linear_weights(bias: float):
    """Weights for ``make_linear_policy`` that make every action ``bias``."""
    from tensordict import TensorDict

    return TensorDict({"module": {"weight": torch.zeros(1, 3), "bias": torch.full((1,), float(bias))}})


class ScaledLinear(torch.nn.Module):
    """A Pendulum policy with a buffer: action = bias * scale (weight zero), so buffers show in actions."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 1)
        self.register_buffer("scale", torch.ones(1))
        with torch.no_grad():
            self.linear.weight.zero_()
            self.linear.bias.fill_(0.5)

    def forward(self, observation):
        return self.linear(observation) * self.scale


def make_scaled_policy():
    from tensordict.nn import TensorDictModule

    return TensorDictModule(ScaledLinear(), in_keys=["observation"], out_keys=["action"])


# Hooks a user assigns after construction: the pre-collect hook counts rollouts in the worker,
# the post-collect hook writes that count into the batch's rewards (in place: new keys added
# after the first batch do not reach the trainer through the collector's shared buffers).
_ROLLOUTS = [0]


def count_rollouts():
    _ROLLOUTS[0] += 1


def write_rollout_count(batch):
    batch["next", "reward"].fill_(float(_ROLLOUTS[0]))


def store_state(store):
    """A store's version and a private copy of its weights, to compare with later."""
    snap = store.snapshot()
    return store.version, snap.weights.clone()


def assert_unchanged(store, before):
    """The store holds what :func:`store_state` recorded: nothing was written."""
    version, weights = before
    assert store.version == version
    after = store.snapshot()
    assert after.version == version
    assert (after.weights == weights).all()


def pendulum_collector(cls, frames_per_batch=40, **kwargs):
    """An unbounded 2-worker collector of Pendulum, its policy's weights all zero, synced by shmsync."""
    from shmsync import ShmWeightSyncScheme

    return cls(
        [make_pendulum] * 2,
        make_linear_policy(0.0),
        frames_per_batch=frames_per_batch,
        total_frames=-1,
        weight_sync_schemes={"policy": ShmWeightSyncScheme()},
        **kwargs,
    )


def _rollout_unhooked_collector_class():
    from torchrl.collectors import Collector

    class RolloutCannotBeShadowed(Collector):
        """A worker collector whose rollout an instance attribute cannot shadow: what shmsync sees
        if TorchRL stops calling ``self.rollout()`` from its worker loop."""

        @property
        def rollout(self):
            return functools.partial(Collector.rollout, self)

    return RolloutCannotBeShadowed


def _policy_unhooked_collector_class():
    from torchrl.collectors import Collector

    class PolicyHooksBypassed(Collector):
        """A worker collector that runs its policy without any module hook: what shmsync sees if
        TorchRL calls the policy another way than through ``nn.Module.__call__``."""

        def rollout(self, *args, **kwargs):
            for module in self.policy.modules():
                module._forward_pre_hooks.clear()
                module._forward_hooks.clear()
            return super().rollout(*args, **kwargs)

    return PolicyHooksBypassed


# -- plays of a TorchRL release that changed (tests/test_torchrl_compat.py) ------------------------
class WrongFrames(AssertionError):
    """A play saw frames that ran stale, mixed or mislabelled weights, or a wrong reported version."""


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise WrongFrames(what)


def _check_tagged(batch, where: str = "") -> list[int]:
    """Every frame of ``batch`` ran one version, whole, tagged with it twice; the versions, sorted."""
    lo, hi = batch["w_lo"], batch["w_hi"]
    _expect(torch.equal(lo, hi), f"{where}a frame ran a mix of two versions")
    for key in ("policy_version", ("next", "policy_version")):
        _expect(key in batch.keys(True), f"{where}frames carry no {key!r}")
        _expect(torch.equal(batch[key], lo.long()), f"{where}{key!r} is not the version whose weights acted")
    return sorted(set(lo.long().flatten().tolist()))


def _check_batch(batch, version: int, where: str = "") -> None:
    """Every frame of ``batch`` ran version ``version``, whole, and is tagged with it twice."""
    lo, hi = batch["w_lo"], batch["w_hi"]
    _expect(torch.equal(lo, hi), f"{where}a frame ran a mix of two versions")
    _expect(bool((lo == version).all()), f"{where}frames ran {lo.unique().tolist()}, not version {version}")
    for key in ("policy_version", ("next", "policy_version")):
        _expect(key in batch.keys(True), f"{where}frames carry no {key!r}")
        _expect(bool((batch[key] == version).all()), f"{where}{key!r} is {batch[key].unique().tolist()}, not {version}")


def _play_size() -> int:
    """Workers, nodes or actors a play runs: 2, or 1 for a play that must end in a named error
    (it ends at the first publish or before; ``SHMSYNC_PLAY_SMALL=1``)."""
    return 1 if os.environ.get("SHMSYNC_PLAY_SMALL") == "1" else 2


def play_multisync(preinitialized: bool = False, publishes: int = 4) -> None:
    """A MultiSyncCollector of 2 workers with track_policy_version: each publish before a batch is
    the version every frame of that batch runs and carries, and the version TorchRL reports."""
    from torchrl.collectors import MultiSyncCollector

    from shmsync import ShmWeightSyncScheme

    policy = make_probe_policy()
    fill(policy, 0)
    scheme = ShmWeightSyncScheme()
    workers = _play_size()
    if preinitialized:
        scheme.init_on_sender(model=policy, devices=["cpu"] * workers)
    collector = MultiSyncCollector(
        [make_pendulum] * workers,
        policy,
        frames_per_batch=40,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
        track_policy_version=True,
    )
    try:
        batches = iter(collector)
        for version in range(publishes + 1):
            if version:
                fill(policy, version)
                collector.update_policy_weights_()
            _check_batch(next(batches), version, f"batch {version}: ")
            reported = collector.get_policy_version()
            _expect(reported == version, f"get_policy_version() is {reported}, the workers run {version}")
        saved = collector.state_dict().get("policy_version")
        _expect(saved in (None, publishes), f"state_dict()['policy_version'] is {saved}, not {publishes}")
    finally:
        collector.shutdown()


def play_multisync_preinitialized() -> None:
    play_multisync(preinitialized=True)


def play_hook() -> None:
    """shmsync's UpdateWeights on a real Trainer: a WeightSender publishes every 2 optimizer steps
    under the step count, through a path naming a module added with register_module."""
    from torchrl.collectors import Collector

    from shmsync import UpdateWeights, WeightSender, WeightStore

    policy = make_policy()
    collector = Collector(make_env, policy, frames_per_batch=20, total_frames=60)
    trainer = make_trainer(collector, make_loss(policy), total_frames=60, optim_steps_per_batch=2)
    trainer.register_module("acting", policy)
    store = WeightStore.create({"policy": policy})
    try:
        hook = UpdateWeights(
            update_weights_interval=2,
            trainer=trainer,
            sender=WeightSender(store, {"policy": "acting"}, root=trainer),
            interval_unit="optim_steps",
            version="optim_steps",
        )
        hook.register(trainer)
        trainer.train()
        _expect(store.version == 6, f"the store holds version {store.version} after 6 optimizer steps, not 6")
        _expect(hook.state_dict()["last_update_count"] == 6, f"the hook's state is {hook.state_dict()}")
    finally:
        store.close()
        collector.shutdown()


def play_distributed(name: str, pushes: int = 4) -> None:
    """shmsync's distributed collector ``name``: 2 nodes of 1 worker, a push before each batch;
    each batch's frames run and carry the trainer's number of the push before it."""
    import shmsync.torchrl.distributed as distributed
    from shmsync import ShmWeightSyncScheme

    policy = make_probe_policy()
    fill(policy, 0)
    nodes = _play_size()
    collector = getattr(distributed, name)(
        [make_pendulum, make_marked_pendulum][:nodes],
        policy,
        collector_class=_multisync(),
        num_workers_per_collector=1,
        frames_per_batch=20 * nodes,
        total_frames=20 * nodes * (pushes + 1),
        collector_kwargs={"weight_sync_schemes": {"policy": ShmWeightSyncScheme()}},
        launcher="mp",
        tcp_port=str(free_ports()),
        **({"sync": True} if name == "DistributedCollector" else {}),
    )
    try:
        if name == "DistributedSyncCollector":
            # It pushes before every batch (push i + 1, filled with i + 1), while its nodes collect
            # on their own: a node's batch runs the push it last applied, never an older one.
            fill(policy, 1)
            seen = {node: [0] for node in range(nodes)}
            for i, batch in enumerate(collector):
                for node in range(nodes):
                    versions = _check_tagged(batch[node], f"batch {i}, node {node + 1}: ")
                    _expect(versions[0] >= seen[node][-1] and versions[-1] <= i + 1, f"node {node + 1} ran {versions}")
                    seen[node] += versions
                fill(policy, i + 2)
            _expect(min(v[-1] for v in seen.values()) >= pushes - 1, f"the nodes fell behind: {seen}")
        else:
            for i, batch in enumerate(collector):
                _check_batch(batch, i, f"batch {i}: ")
                fill(policy, i + 1)
                collector.update_policy_weights_()
    finally:
        collector.shutdown()


def play_distributed_sync() -> None:
    play_distributed("DistributedSyncCollector")


def play_distributed_generic() -> None:
    play_distributed("DistributedCollector")


def play_ray(pushes: int = 4) -> None:
    """shmsync's RayCollector: 2 actors of 1 worker on a local cluster, a push to both before
    each batch; each batch's frames run and carry the trainer's number of that push."""
    import ray

    from shmsync import ShmWeightSyncScheme
    from shmsync.torchrl.distributed import RayCollector

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        policy = make_probe_policy()
        fill(policy, 0)
        actors = _play_size()
        collector = RayCollector(
            [make_pendulum, make_marked_pendulum][:actors],
            policy,
            collector_class=_multisync(),
            collector_kwargs={"num_workers": 1, "weight_sync_schemes": {"policy": ShmWeightSyncScheme()}},
            remote_configs={"num_cpus": 1},
            frames_per_batch=40 * actors,
            total_frames=40 * actors * (pushes + 1),
            sync=True,
        )
        try:
            for i, batch in enumerate(collector):
                _check_batch(batch, i, f"batch {i}: ")
                fill(policy, i + 1)
                collector.update_policy_weights_(policy)
        finally:
            collector.shutdown()
    finally:
        ray.shutdown()


def _multisync():
    from torchrl.collectors import MultiSyncCollector

    return MultiSyncCollector


def free_ports(n: int = 3) -> int:
    """A port p with p .. p+n-1 free (TorchRL's distributed collectors use tcp_port, +1 and +2)."""
    import socket

    for _ in range(100):
        with socket.socket() as s:
            s.bind(("", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as t:
                    t.bind(("", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free block of ports")


def play(name: str) -> None:
    """Run play ``name`` in this process (one whose TorchRL tests/torchrl_edits rewrote) and print
    its outcome as one line, ``RESULT {json}``: ok, named (a TorchRLChangedError naming an entry),
    wrong (frames or reported versions) or error (anything else)."""
    import json
    import re

    try:
        globals()[f"play_{name}"]()
        outcome = {"outcome": "ok"}
    except WrongFrames as e:
        outcome = {"outcome": "wrong", "detail": str(e)}
    except BaseException as e:  # the outcome is the report
        text = f"{type(e).__name__}: {e}"
        found = re.search(r'TorchRL internal "([^"]+)"', text)
        outcome = {"outcome": "named" if found else "error", "entry": found and found.group(1), "detail": text[-4000:]}
    print("RESULT " + json.dumps(outcome), flush=True)


def __getattr__(name: str):
    # Collector subclasses for the workers, made on first use so that importing helpers stays
    # free of TorchRL; module-level names, so that spawned workers find them.
    makers = {
        "RolloutCannotBeShadowed": _rollout_unhooked_collector_class,
        "PolicyHooksBypassed": _policy_unhooked_collector_class,
    }
    if name in makers:
        cls = makers[name]()
        cls.__module__, cls.__qualname__ = __name__, name
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def poll_in_place(store: WeightStore, sizes, conn) -> None:
    """Run on the store's memory in place, polling every millisecond until killed."""
    module = ParamBlob(sizes)
    reader = WeightReader(store, module)
    reader.poll()
    conn.send(("loaded", reader.viewing, reader.version))
    while True:
        reader.poll()
        time.sleep(0.001)


# -- GPU readers (tests/test_cuda.py) ----------------------------------------------------------------
def cuda_layers():
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))


def cuda_reader(name: str, device: str, versions: int, options: dict, conn) -> None:
    """A reader of store ``name`` in its own process, its module on ``device`` (``"cpu"`` too):
    for each version 1..``versions`` it waits for it and reports whether every weight holds that
    version's number, whether its parameters view shared memory, and the memory it holds itself."""
    from shmsync import WeightReader, WeightStore

    store = WeightStore.attach(name)
    module = cuda_layers().to(device)
    reader = WeightReader(store, module, **options)
    reader.poll()
    conn.send(("ready", reader.viewing))
    for version in range(1, versions + 1):
        reader.wait(version, timeout=60)
        values = {float(v) for p in module.parameters() for v in p.detach().unique().cpu()}
        conn.send(("loaded", reader.version, values == {float(reader.version)}, reader.viewing))
    conn.recv()  # the parent has read the readers' table
    reader.close()
    store.close()


def server_handshake(sock, secret: bytes, timeout: float, *, encrypt: bool = True):
    """The server's side of a relay handshake on a blocking socket (the relay's own server runs it
    on non-blocking sockets: ``shmsync.relay.acceptor``); the connection's keys."""
    from shmsync.relay import wire

    deadline = time.monotonic() + timeout
    side = wire.ServerSide(secret, encrypt)
    sock.settimeout(timeout)
    sock.sendall(side.hello())
    try:
        reply, keys = side.answer(wire._recv_exactly(sock, wire.CLIENT_HELLO, deadline, "handshake"))
    except wire.Refused as e:
        sock.sendall(e.reply)
        raise
    sock.sendall(reply)
    return keys
