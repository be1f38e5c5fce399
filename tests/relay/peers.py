"""The processes of the relay tests, each "host" with a store folder of its own: relays, readers on
those hosts, trainers, and the hostile peers that flood, trickle or stall; the server's side of a
handshake, and the shared secret."""

from __future__ import annotations

import os
import time

import torch

from shmsync import WeightReader, WeightStore
from shmsync.relay import wire
from tests.processes import use_store_dir
from tests.weights import Blob, blob_weights, mixed_values, set_all

SECRET = "the relay tests' secret, 32 bytes"


def run_relay(host_dir: str, port: int, name: str, max_versions, precreate, conn) -> None:
    """A relay for host ``host_dir``; reports ("done", versions received, store version) or the error."""
    use_store_dir(host_dir)
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
                relay.store.add_listener(on_publish)
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


def _attach_once_made(host_dir: str, name: str, deadline: float) -> WeightStore | None:
    """Store ``name`` on host ``host_dir``, attached as soon as its relay made it (None if it did
    not by ``deadline``)."""
    from shmsync import StoreNotFoundError

    use_store_dir(host_dir)
    while True:
        try:
            return WeightStore.attach(name)
        except StoreNotFoundError:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)


def follow(host_dir: str, name: str, sizes, last: int, conn) -> None:
    """A reader on host ``host_dir``: loads every version it sees until ``last``; reports, per
    load, (version, distinct values in the weights)."""
    deadline = time.monotonic() + 60
    store = _attach_once_made(host_dir, name, deadline)
    if store is None:
        conn.send(("error", "no store"))
        return
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
    deadline = time.monotonic() + 60
    store = _attach_once_made(host_dir, name, deadline)
    if store is None:
        conn.send(("error", "no store"))
        return
    reader = WeightReader(store, Blob(sizes), worker=worker)
    reader.poll()
    conn.send(("attached", os.getpid()))
    while True:
        reader.poll()
        time.sleep(0.01)


def trainer(sizes, conn) -> None:
    """A trainer with a RelaySender, publishing until killed."""
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


SIZES = {"a": 300_000, "b": 1_000, "c": 7}  # ~1.2 MB: several 256 KB buckets


def start_relay(start, host, port, precreate=None):
    """A relay process for ``host``, once it is about to join."""
    relay = start(run_relay, host, port, "policy", None, precreate)
    relay.expect("started")
    return relay


def slowest_publish(store, weights, n: int = 40, gap: float = 0.0) -> float:
    """Publish ``n`` more versions (every weight = its version), ``gap`` seconds apart; the
    slowest publish() in seconds."""
    slowest = 0.0
    for _ in range(n):
        set_all(weights, store.version + 1)
        began = time.perf_counter()
        store.publish(weights)
        slowest = max(slowest, time.perf_counter() - began)
        time.sleep(gap)
    return slowest


def join_as_relay(port, serve=None, node=None):
    """A link that joined the trainer as a relay would (JOIN sent); returns it and its node id."""
    node = node or os.urandom(8).hex()
    link = wire.connect("127.0.0.1", port, SECRET.encode(), 5)
    link.send_json(b"JOIN", {"node": node, "serve": serve})
    return link, node


def admitted(link, have):
    """Take the layout and the tree's settings, then answer HAVE ``have``; the settings."""
    kind, _ = link.recv_frame({b"LYOT": 64 << 20}, 5)
    link.recv_payload(5)
    _, conf = link.recv_json({b"CONF": 4096}, 5)
    link.send_json(b"HAVE", {"version": have})
    return conf


def host_dirs(tmp_path, n):
    paths = []
    for i in range(n):
        path = tmp_path / f"host-{i}"
        path.mkdir()
        paths.append(str(path))
    return paths


def weights_digest(tensors) -> str:
    """The bytes of ``tensors`` (name -> tensor), in name order, as one hex digest."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def delta_host(host_dir: str, port: int, name: str, sizes, encrypt: bool, conn) -> None:
    """A host: its relay, and a copying reader of its store. Says ("ready", parent port, serving address)
    once its store exists; then, asked ("hold", v), waits until its reader holds version ``v`` and
    answers ("holds", version, digest of the reader's weights, what the last version cost the
    relay's link as sent upstream); ("stop",) ends it. A relay error is answered ("error", ...)."""
    import threading

    use_store_dir(host_dir)
    from shmsync.relay import Relay

    relay = Relay("127.0.0.1", port, store=name, secret=SECRET, timeout=30, encrypt=encrypt)
    failed: list[str] = []

    def run():
        try:
            relay.run()
        except Exception as e:
            failed.append(f"{type(e).__name__}: {e}")

    threading.Thread(target=run, daemon=True).start()
    deadline = time.monotonic() + 60
    while relay.store is None and not failed and time.monotonic() < deadline:
        time.sleep(0.005)
    if relay.store is None:
        conn.send(("error", failed[0] if failed else "no store in 60 s"))
        return
    store = WeightStore.attach(name)
    module = Blob(sizes)
    reader = WeightReader(store, module, zero_copy=False)  # a copying reader: only what the records say changed
    reader.poll()
    conn.send(("ready", relay.parent[1], relay.serving))
    try:
        while True:
            message = conn.recv()
            if message[0] == "stop":
                return
            want, deadline = message[1], time.monotonic() + 60
            while not failed and time.monotonic() < deadline:
                counted = relay.transfer is not None and relay.transfer.version >= want  # noted after the commit
                if reader.version >= want and counted:
                    break
                if not reader.poll():
                    time.sleep(0.001)
            if failed:
                conn.send(("error", failed[0]))
                return
            transfer = relay.transfer.to_wire() if relay.transfer is not None else None
            conn.send(("holds", reader.version, weights_digest(dict(module.named_buffers())), transfer))
    finally:
        reader.close()
        store.close()
        relay.close()
