"""The relay: a trainer's versions published on other hosts, each host a process with its own
store directory, linked by the relay's encrypted TCP links on loopback; and every peer that
breaks the protocol, floods, stalls or lies, each refused in bounded time and memory."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from shmsync.relay import RelaySender, sealing, wire

import helpers
from helpers import SECRET, blob_weights, cli, server_handshake, set_all, wait_for

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(120)]

SIZES = {"a": 300_000, "b": 1_000, "c": 7}  # ~1.2 MB: several 256 KB buckets


def start_relay(start, host, port, precreate=None):
    """A relay process for ``host``, once it is about to join."""
    relay = start(helpers.run_relay, host, port, "policy", None, precreate)
    relay.expect("started")
    return relay


@pytest.fixture
def host(tmp_path):
    """Another host's shared memory: a directory of its own."""
    path = tmp_path / "host-b"
    path.mkdir()
    return str(path)


def test_a_relay_publishes_the_trainers_versions_on_its_host(store_factory, start, host):
    weights = blob_weights(SIZES, 0.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, bucket_bytes=256 << 10) as sender:
        relay = start_relay(start, host, sender.port)
        reader = start(helpers.follow, host, "policy", SIZES, 20)
        (first,) = reader.expect("attached")
        assert first == 0  # the trainer's version when the relay joined
        for version in list(range(1, 11)) + [20]:  # versions may skip: the trainer's numbers
            set_all(weights, version)
            store.publish(weights, version=version)
            time.sleep(0.02)
        (seen,) = reader.expect("seen")
        wait_for(lambda: max(sender.relays.values(), default=-1) == 20, what="the relay to be sent version 20")
    received, host_version = relay.expect("done")
    assert host_version == 20
    assert seen[-1][0] == 20
    for version, values in seen:
        assert values == [float(version)], f"version {version} on the other host held {values}"
    assert [v for v, _ in seen] == sorted({v for v, _ in seen}), "versions went back"
    assert 1 <= received <= 12  # version 0, then at most one per publish


def test_a_host_that_joins_late_starts_at_the_trainers_current_version(store_factory, start, host):
    weights = blob_weights(SIZES, 7.0)
    store = store_factory(weights)
    store.publish(weights, version=7)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        relay = start_relay(start, host, sender.port)
        reader = start(helpers.follow, host, "policy", SIZES, 7)
        (first,) = reader.expect("attached")
        (seen,) = reader.expect("seen")
    assert first == 7 and seen == [(7, [7.0])], "the host's first version must be the trainer's current one"
    assert relay.expect("done") == (1, 7)


def test_a_relay_whose_host_store_holds_another_model_writes_nothing(store_factory, start, host):
    store = store_factory(blob_weights(SIZES, 1.0))
    other = {"a": 300_000, "b": 999, "c": 7}
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        relay = start_relay(start, host, sender.port, other)
        kind, message, version, values = relay.expect("error", timeout=60)
        wait_for(lambda: sender.dropped, what="the sender to drop the relay")
    assert kind == "WeightMismatchError"
    assert "'b' has shape (999,) here, (1000,) on the trainer" in message
    assert version == 0 and values == [5.0], "the host's store changed"


def test_relays_exit_soon_after_the_trainer_dies(start, host):
    trainer = start(helpers.trainer, SIZES)
    name, port = trainer.expect("ready")
    relay = start_relay(start, host, port)
    trainer.expect("linked", timeout=60)
    killed = time.monotonic()
    os.kill(trainer.pid, signal.SIGKILL)
    kind, message, *_ = relay.expect("error", timeout=30)
    assert kind == "TrainerGoneError", message
    assert time.monotonic() - killed < 10
    relay.proc.join(10)
    assert not relay.proc.is_alive()
    assert not os.listdir(host), "the relay's store outlived it"
    # The dead trainer's own store is left to `shmsync gc`, as on one host.
    assert [r["name"] for r in json.loads(cli("gc", name, "--json").stdout)["removed"]] == [name]


def test_a_relay_killed_mid_receive_leaves_its_host_whole_and_a_new_relay_catches_up(store_factory, start, host):
    big = {"a": 6_000_000, "b": 7}  # 24 MB: a version takes a while to cross
    weights = blob_weights(big, 0.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, bucket_bytes=1 << 20) as sender:
        first = start_relay(start, host, sender.port)
        wait_for(lambda: sender.relays.get(1, -1) >= 0, what="the first relay to link")
        version = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # publish flat out: the relay is always receiving
            version += 1
            set_all(weights, version)
            store.publish(weights)
        os.kill(first.pid, signal.SIGKILL)  # most likely mid-receive
        first.proc.join(10)
        # Its host keeps a whole version: a reader there loads one complete version.
        reader = start(helpers.follow, host, "policy", big, 0)
        (held,) = reader.expect("attached")
        ((loaded, values),) = reader.expect("seen")[0]
        assert loaded == held and values == [float(held)], f"version {held} on the host held {values}"
        # A new relay takes the writer role over and catches up to the newest version.
        second = start_relay(start, host, sender.port)
        for _ in range(3):
            version += 1
            set_all(weights, version)
            store.publish(weights)
        wait_for(lambda: sender.relays.get(2, -1) == version, what="the new relay to catch up")
        assert 1 in sender.dropped, "the killed relay's link was not dropped"
    received, host_version = second.expect("done")
    assert host_version == version


def _slowest_publish(store, weights, n: int = 40, gap: float = 0.0) -> float:
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


def test_a_stalled_host_slows_neither_the_trainer_nor_the_other_hosts(store_factory, start, tmp_path):
    hosts = [tmp_path / "host-b", tmp_path / "host-c"]
    for path in hosts:
        path.mkdir()
    weights = blob_weights(SIZES, 0.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, bucket_bytes=256 << 10, fanout=2) as sender:
        relays = [start_relay(start, str(h), sender.port) for h in hosts]
        wait_for(lambda: len(sender.relays) == 2 and min(sender.relays.values()) >= 0, what="both relays to link")
        stalled = relays[1]
        os.kill(stalled.pid, signal.SIGSTOP)  # host C stops receiving, mid-version or between
        try:
            slowest = _slowest_publish(store, weights, 40, gap=0.005)
            wait_for(lambda: max(sender.relays.values()) == 40, what="the running host to get version 40")
            assert slowest < 0.25, f"a publish took {slowest:.3f}s while a host was stalled"
            assert min(sender.relays.values()) < 40, "the stalled host kept up: the test stalled nothing"
        finally:
            os.kill(stalled.pid, signal.SIGCONT)
        # Resumed, the stalled host skips to the newest version (latest wins).
        wait_for(lambda: min(sender.relays.values()) == 40, what="the stalled host to catch up")
    (_, version_b), (received_c, version_c) = (relay.expect("done") for relay in relays)
    assert version_b == version_c == 40
    assert received_c < 40, "the stalled host was sent every version instead of the newest"


def test_the_default_shape_is_a_chain_once_a_version_spans_eight_buckets(store_factory):
    store = store_factory(blob_weights(SIZES, 1.0))  # 1.2 MB
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, bucket_bytes=256 << 10) as sender:
        assert sender.fanout == 2  # five buckets
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, bucket_bytes=150_000) as sender:
        assert sender.fanout == 1  # eight
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, bucket_bytes=150_000, fanout=3) as sender:
        assert sender.fanout == 3


def test_the_relay_command_follows_the_trainer_until_it_closes(store_factory, host):
    weights = blob_weights(SIZES, 3.0)
    store = store_factory(weights)
    store.publish(weights, version=3)
    env = {**os.environ, "SHMSYNC_DIR": host}
    env["SHMSYNC_RELAY_SECRET"] = SECRET
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        connect = f"127.0.0.1:{sender.port}"
        cmd = [sys.executable, "-m", "shmsync.workers.relay", "--connect", connect, "--store", "policy"]
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: sender.relays.get(1) == 3, what="the relay command to link")
        except BaseException:
            proc.kill()
            raise
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "closed its sender after 1 versions" in err


@pytest.mark.slow
def test_workers_launched_with_a_relay_run_the_trainers_versions_and_stop_with_it(store_factory, start, host):
    from torchrl.envs import GymEnv

    from shmsync.workers.policies import mlp_policy

    policy = mlp_policy(GymEnv("CartPole-v1"))
    store = store_factory(policy)
    store.publish(policy, version=5)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        workers = start(helpers.host_with_workers, host, sender.port, "policy", daemon=False)
        (versions,) = workers.expect("batch", timeout=90)
        assert versions == [5], "the host's workers must start at the trainer's version"
        store.publish(policy, version=9)
        deadline = time.monotonic() + 60
        while versions != [9] and time.monotonic() < deadline:
            (versions,) = workers.expect("batch")
        assert versions == [9]
    # The trainer closed its sender: the relay ends, and the workers with it, cleanly.
    while True:
        kind, *rest = workers.conn.recv() if workers.conn.poll(60) else ("timeout",)
        if kind != "batch":
            break
    assert kind == "ended", kind
    codes, relay_code = rest
    assert relay_code == 0 and all(code == 0 for code in codes.values()), (codes, relay_code)
    workers.proc.join(10)
    assert not os.listdir(host), "the host's store outlived its relay"


# -- hostile peers ----------------------------------------------------------------------------
def _stranger(port, secret=b"not the relay secret, but thirty-two bytes long", speak=True):
    """Connect as someone who does not hold the secret; returns every byte the server sent."""
    import socket as socket_module

    sock = socket_module.create_connection(("127.0.0.1", port), timeout=10)
    got = b""
    try:
        while len(got) < wire.SERVER_HELLO:
            got += sock.recv(4096)
        if speak:
            ours, mode = os.urandom(32), b"\x01"
            transcript = wire.MAGIC + got[len(wire.MAGIC) :] + ours + mode
            sock.sendall(wire.MAGIC + ours + mode + wire._mac(secret, b"client", transcript))
            while chunk := sock.recv(65536):
                got += chunk
    finally:
        sock.close()
    return got


def test_a_stranger_gets_a_nonce_and_a_refusal_only_and_the_trainer_keeps_its_pace(store_factory, start, host):
    weights = blob_weights(SIZES, 1.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        calm = _slowest_publish(store, weights)
        got = _stranger(sender.port)
        assert got[wire.SERVER_HELLO :] == bytes([wire.REFUSED]), "a peer without the secret was sent more"
        wait_for(lambda: sender.refused == 1, what="the stranger to be refused")
        # A real relay still links, and the trainer publishes as before.
        relay = start_relay(start, host, sender.port)
        wait_for(lambda: sender.relays.get(1, -1) == store.version, what="the real relay to link")
        assert _slowest_publish(store, weights) < max(0.1, 20 * calm)
        assert sender.dropped == {}
    relay.expect("done")


def _joins_within_5_s(start, host, sender):
    """A relay for ``host``, joined within 5 s of its process being up (the flood's doing, not the spawn's)."""
    relay = start_relay(start, host, sender.port)
    began = time.monotonic()
    wait_for(lambda: 1 in sender.relays, timeout=30, what="a real relay to get past the flood")
    joined = time.monotonic() - began
    assert joined < 5.0, f"the relay took {joined:.1f} s to join through the flood"
    return relay


@pytest.mark.timeout(120)
def test_a_relay_joins_within_5_s_while_1000_connections_stall_mid_handshake_or_reconnect_in_a_loop(
    store_factory, start, host
):
    import threading

    weights = blob_weights(SIZES, 1.0)
    store = store_factory(weights)
    threads_before = threading.active_count()
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        flood = start(helpers.flood, sender.port, 1000)
        flood.expect("flooding", timeout=60)  # 1000 open, half silent, half cut off mid-hello; a loop reconnects
        wait_for(lambda: sender.refused >= 1000, timeout=30, what="the flood's connections to be cut")
        relay = _joins_within_5_s(start, host, sender)
        assert threading.active_count() <= threads_before + 8, "threads grew with the connections"
        assert _slowest_publish(store, weights) < 0.25
        flood.proc.kill()
        began = time.monotonic()
    assert time.monotonic() - began < 3.0, "close() took too long"
    relay.expect("done")


@pytest.fixture
def few_descriptors():
    """This process may open 1,024 descriptors while the test runs: a server started now takes a
    quarter of them, 256, as its handshakes under way, which a flood can fill."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.timeout(120)
def test_a_relay_joins_within_5_s_while_a_flood_trickles_bytes_on_every_handshake_place(
    store_factory, start, host, few_descriptors
):
    """Every handshake place is taken by a connection that sends a byte now and then and never
    finishes, and a new one comes every 10 ms: the relay's own handshake must not be the one cut."""
    weights = blob_weights(SIZES, 1.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        flood = start(helpers.trickle, sender.port, 300)
        flood.expect("flooding", timeout=60)
        wait_for(lambda: sender.refused >= 50, timeout=30, what="the places to fill and handshakes to be cut")
        relay = _joins_within_5_s(start, host, sender)
        wait_for(lambda: sender.relays.get(1) == store.version, what="the relay to take the version")
        flood.proc.kill()
    relay.expect("done")


def test_a_silent_connection_is_cut_within_a_second_or_two(store_factory):
    import socket as socket_module

    store = store_factory(blob_weights(SIZES, 1.0))
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, handshake_timeout=30) as sender:
        sock = socket_module.create_connection(("127.0.0.1", sender.port), timeout=10)
        began = time.monotonic()
        assert len(sock.recv(4096)) == wire.SERVER_HELLO
        assert sock.recv(1) == b"", "the server kept a silent connection"
        assert time.monotonic() - began < 2.5
        sock.close()


def test_it_listens_on_the_address_it_is_given_only(store_factory):
    import socket as socket_module

    store = store_factory(blob_weights(SIZES, 1.0))
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        with pytest.raises(ConnectionRefusedError):
            socket_module.create_connection(("127.0.0.2", sender.port), timeout=5)  # another loopback address
        socket_module.create_connection(("127.0.0.1", sender.port), timeout=5).close()


def test_a_relay_that_proves_the_secret_but_breaks_the_protocol_is_dropped(store_factory):
    weights = blob_weights(SIZES, 1.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        for bad in (
            lambda link: link.sock.sendall(wire.FRAME.pack(b"JOIN", 1 << 40)),  # refused before any allocation
            lambda link: link.send(b"VERS", b"\0" * 16),  # not what comes first
            lambda link: link.send(b"JOIN", b'{"node":1'),  # not JSON
            lambda link: link.send_json(b"JOIN", {"node": "x", "serve": None}),  # not a node id
            lambda link: link.sock.sendall(wire.FRAME.pack(b"JOIN", 10) + b"\0" * 26),  # fails its check
        ):
            link = wire.connect("127.0.0.1", sender.port, SECRET.encode(), 5)
            bad(link)
            assert link.sock.recv(1) == b"", "the server kept a link that broke the protocol"
            link.close()
        wait_for(lambda: sender.refused == 5, what="each to be dropped")
        assert _slowest_publish(store, weights) < 0.25 and sender.relays == {}


@pytest.mark.timeout(60)
def test_close_returns_in_time_while_a_stalled_relay_is_mid_version(store_factory, start, host):
    big = {"a": 6_000_000, "b": 7}  # 24 MB
    weights = blob_weights(big, 0.0)
    store = store_factory(weights)
    sender = RelaySender(store, "127.0.0.1", 0, secret=SECRET, bucket_bytes=1 << 20)
    relay = start_relay(start, host, sender.port)
    try:
        wait_for(lambda: sender.relays.get(1, -1) >= 0, what="the relay to link")
        os.kill(relay.pid, signal.SIGSTOP)
        for v in range(1, 4):
            set_all(weights, v)
            store.publish(weights)  # the link thread blocks in a send the relay does not read
        time.sleep(0.5)
        began = time.monotonic()
        sender.close()
        assert time.monotonic() - began < 2.5, "close() waited on a stalled relay"
    finally:
        os.kill(relay.pid, signal.SIGCONT)
    kind, *rest = relay.conn.recv() if relay.conn.poll(60) else ("silent",)
    assert kind in ("done", "error"), kind  # it ends either way, and never publishes a cut version


class FakeTrainer:
    """A server that proves ``secret`` and then runs ``script(link, attempt)`` on each relay that
    connects: a trainer's sender gone wrong, for the relay's side of the checks."""

    def __init__(self, script, secret=SECRET):
        import socket as socket_module
        import threading

        self.script, self.secret = script, secret.encode()
        self.sock = socket_module.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.attempts = 0
        self.errors = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                sock, _ = self.sock.accept()
            except OSError:
                return
            self.attempts += 1
            try:
                keys = server_handshake(sock, self.secret, 5)
                link = wire.Link(sock, "relay", keys)
                _, self.joined = link.recv_json({b"JOIN": 4096}, 5)
                self.script(link, self.attempts)
            except Exception as e:  # the relay hung up on us: what we want
                self.errors.append(e)
            finally:
                sock.close()

    def close(self):
        self.sock.close()


def _description(sizes=SIZES):
    from shmsync import WeightStore

    store = WeightStore.create(blob_weights(sizes, 0.0))
    try:
        return store.memory.layout_description, store.nbytes
    finally:
        store.close()


def _admit(link, description, path=("0123456789abcdef",)):
    link.send(b"LYOT", description)
    link.send_json(b"CONF", {"fanout": 2, "path": list(path), "bucket": 1 << 24})
    return link.recv_json({b"HAVE": 4096, b"MISM": 4096}, 5)[1]


def _version(link, version, nbytes, pieces):
    """A version as a trainer sends it: VERS, then ``pieces`` as DATA frames (on an encrypted link
    each sealed as :mod:`shmsync.relay.sealing` seals it, in pieces of the first one's size)."""
    import struct

    if link.keys is None:
        link.send(b"VERS", struct.pack(">qQ", version, nbytes))
        for piece in pieces:
            link.send(b"DATA", piece)
        return
    salt, size = os.urandom(sealing.SALT_BYTES), len(pieces[0]) if pieces and pieces[0] else nbytes
    aead = sealing._key(SECRET.encode(), salt, version, nbytes, size)
    frames = [aead.encrypt(sealing._nonce(i), p, sealing._aad(i)) if p else b"" for i, p in enumerate(pieces)]
    _send_sealed(link, version, nbytes, size, salt, frames)


def _relay_against(fake, host, timeout=3.0):
    """Run a relay for ``host`` against ``fake`` in this process: its error (or None), and a
    snapshot of its host's store before it closed (or None)."""
    from shmsync.relay import Relay

    helpers.use_store_dir(host)
    relay = Relay("127.0.0.1", fake.port, store="policy", secret=SECRET, timeout=timeout, listen=None)
    error = snapshot = None
    try:
        relay.run()
    except Exception as e:
        error = e
    finally:
        if relay.store is not None:
            snapshot = relay.store.snapshot()
        relay.close()
        fake.close()
    return error, snapshot


def _chain(error):
    out = []
    while error is not None:
        out.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return " <- ".join(out)


@pytest.fixture
def one_host(host, monkeypatch):
    from shmsync.core import segment

    monkeypatch.setattr(segment, "SHM_DIR", host)  # restored after the test
    return host


@pytest.mark.parametrize(
    "hostile, match",
    [
        ("huge layout", r"LYOT message of 1099511627776 bytes"),
        ("garbage layout", r"not valid JSON"),
        ("bad conf", r"tree's settings"),
        ("short version", r"announced 100 bytes for version 1"),
        ("long piece", r"DATA message of"),
        ("empty piece", r"DATA message of 0 bytes"),
        ("pieces of 1 byte", r"piece size is 1 bytes; 4096 to"),  # 17 bytes held for each
        ("a version inside a version", r"sent a b'VERS' message where only"),
        ("negative version", r"sent version -1"),
        ("a version header of 8 bytes", r"VERS message of 8 bytes; one of exactly 56 bytes was expected"),
        ("the largest version", r"sent version 9223372036854775807"),
        ("a layout of 2**61 bytes", r"past 1099511627776"),
        ("30 MiB of lists", r"lists; a layout of at most"),
        ("a frame altered on the way", r"failed its check"),
    ],
)
def test_a_trainer_that_breaks_the_protocol_never_gets_a_byte_published(one_host, hostile, match):
    layout, nbytes = _description()

    def script(link, attempt):
        if hostile == "huge layout":
            link.sock.sendall(wire.FRAME.pack(b"LYOT", 1 << 40))
        elif hostile == "garbage layout":
            link.send(b"LYOT", b"{" * 100)
        elif hostile == "bad conf":
            link.send(b"LYOT", layout)
            link.send_json(b"CONF", {"fanout": -1, "path": "x"})
        elif hostile == "a layout of 2**61 bytes":
            doc = json.loads(layout)
            doc["entries"][-1][1], doc["entries"][-1][4] = [1 << 59], 1 << 61  # int64: 2**61 bytes
            link.send(b"LYOT", json.dumps(doc).encode())
        elif hostile == "30 MiB of lists":
            link.send(b"LYOT", b'{"destinations":null,"entries":[' + b"[]," * (10 << 20) + b"[]]}")
        elif hostile == "a frame altered on the way":
            link.sock.sendall(wire.FRAME.pack(b"LYOT", len(layout)) + layout + b"\0" * 16)
        else:
            assert _admit(link, layout) == {"version": -1}
            if hostile == "short version":
                _version(link, 1, 100, [b"x" * 100])
            elif hostile == "long piece":
                _version(link, 1, nbytes, [b"x" * (nbytes + 1)])
            elif hostile == "empty piece":
                _version(link, 1, nbytes, [b""])
            elif hostile == "pieces of 1 byte":
                _version(link, 1, nbytes, [b"x"])
            elif hostile == "a version inside a version":
                _version(link, 1, nbytes, [b"x" * 4096])
                _version(link, 2, nbytes, [])
            elif hostile == "negative version":
                _version(link, -1, nbytes, [])
            elif hostile == "a version header of 8 bytes":
                link.send(b"VERS", b"\0" * 8)
            elif hostile == "the largest version":
                _version(link, (1 << 63) - 1, nbytes, [b"x" * nbytes])
        link.sock.recv(1)  # until the relay hangs up

    error, snapshot = _relay_against(FakeTrainer(script), one_host)
    assert error is not None and re.search(match, _chain(error)), _chain(error)
    assert snapshot is None
    assert os.listdir(one_host) == [], "something was published on the relay's host"


def test_a_version_cut_short_or_cancelled_leaves_the_host_on_its_last_whole_version(one_host):
    layout, nbytes = _description()

    def script(link, attempt):
        have = _admit(link, layout)
        if attempt == 1:
            assert have == {"version": -1}
            _version(link, 3, nbytes, [b"\x03" * nbytes])  # a whole version: published
            _version(link, 4, nbytes, [b"\x04" * 4096])
            link.send(b"CNCL")  # cancelled: never published
            _version(link, 5, nbytes, [b"\x05" * 4096])  # then the trainer vanishes mid-version
        else:
            assert have == {"version": 3}, "the relay came back holding another version"
            link.send(b"STOP")

    error, snap = _relay_against(FakeTrainer(script), one_host)
    assert error is None, _chain(error)
    assert snap.version == 3 and all(bool((t.view(torch.uint8) == 3).all()) for t in snap.weights.values())


def _sealed(version, payload, size, salt):
    """``payload`` sealed as the trainer seals a version: its pieces, as the wire carries them."""
    aead = sealing._key(SECRET.encode(), salt, version, len(payload), size)
    offsets = range(0, len(payload), size)
    return [aead.encrypt(sealing._nonce(i), payload[o : o + size], sealing._aad(i)) for i, o in enumerate(offsets)]


def _send_sealed(link, version, nbytes, size, salt, frames):
    link.send(b"VERS", sealing.HEADER.pack(version, nbytes, size, salt))
    for frame in frames:
        link.send_or_keep(b"DATA", frame, sealed=True)


@pytest.mark.parametrize(
    "attack, bad",
    [
        ("an old version's pieces replayed under the new header", 0),
        ("pieces of two versions mixed", 2),
        ("two pieces swapped", 0),
        ("a piece of another sealing of the same version", 1),
        ("a piece altered", 3),
    ],
)
def test_sealed_pieces_not_of_this_version_in_this_place_are_refused_and_the_host_keeps_its_version(
    one_host, attack, bad
):
    """A peer on the path can replay, mix, reorder, swap in or alter the sealed pieces (they travel
    without the link's own seal; the header, a control frame, it cannot touch). Each is refused at
    the piece it broke, and the host stays on its last whole version."""
    layout, nbytes = _description()
    size = 256 << 10  # five pieces

    def script(link, attempt):
        assert _admit(link, layout) == {"version": -1}
        salt1, salt2 = os.urandom(32), os.urandom(32)
        one = _sealed(1, b"\x01" * nbytes, size, salt1)
        _send_sealed(link, 1, nbytes, size, salt1, one)
        two = _sealed(2, b"\x02" * nbytes, size, salt2)
        if attack.startswith("an old version's"):
            frames = one
        elif attack == "pieces of two versions mixed":
            frames = two[:2] + one[2:]
        elif attack == "two pieces swapped":
            frames = [two[1], two[0], *two[2:]]
        elif attack.startswith("a piece of another sealing"):
            frames = [two[0], _sealed(2, b"\x02" * nbytes, size, os.urandom(32))[1], *two[2:]]
        else:
            frames = list(two)
            frames[3] = frames[3][:100] + bytes([frames[3][100] ^ 0x40]) + frames[3][101:]
        _send_sealed(link, 2, nbytes, size, salt2, frames)
        link.sock.recv(1)  # until the relay hangs up

    error, snap = _relay_against(FakeTrainer(script), one_host)
    assert type(error).__name__ == "AuthenticationError", _chain(error)
    assert f"piece {bad} of version 2 failed its check" in str(error), str(error)
    assert snap.version == 1 and all(bool((t.view(torch.uint8) == 1).all()) for t in snap.weights.values())


def test_a_trainer_without_the_secret_is_refused_at_once(one_host):
    fake = FakeTrainer(lambda link, attempt: None, secret="a trainer with another secret")
    began = time.monotonic()
    error, _ = _relay_against(fake, one_host, timeout=30)
    assert type(error).__name__ == "AuthenticationError" and time.monotonic() - began < 5
    assert fake.attempts == 1 and os.listdir(one_host) == []


# -- trees of relays -----------------------------------------------------------------------------
def _hosts(tmp_path, n):
    paths = []
    for i in range(n):
        path = tmp_path / f"host-{i}"
        path.mkdir()
        paths.append(str(path))
    return paths


def _grow(start, sender, hosts):
    """A tree relay per host, started one after the other (so the tree's shape is known):
    returns the relays and, per relay, the address it receives from and the one it serves."""
    relays, where = [], []
    for host in hosts:
        relay = start(helpers.tree_relay, host, sender.port, "policy")
        parent, serving = relay.expect("attached", timeout=60)
        relays.append(relay)
        where.append((tuple(parent), tuple(serving)))
    return relays, where


def _versions(relay):
    relay.conn.send("report")
    (published,) = relay.expect("versions")
    return published


def _wait_versions(relays, last, timeout=60.0):
    deadline = time.monotonic() + timeout
    while True:
        seen = [_versions(r) for r in relays]
        if all(p and p[-1][0] == last for p in seen) or time.monotonic() > deadline:
            return seen
        time.sleep(0.05)


def test_every_host_of_a_tree_gets_the_trainers_versions_and_the_trainer_sends_each_once_per_child(
    store_factory, start, tmp_path
):
    # A tree of fan-out 2; the chain (fan-out 1) is the shape of the two tests after this one.
    fanout = 2
    weights = blob_weights(SIZES, 0.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, fanout=fanout, bucket_bytes=256 << 10) as sender:
        relays, where = _grow(start, sender, _hosts(tmp_path, 4))
        parents = [parent for parent, _ in where]
        trainer = ("127.0.0.1", sender.port)
        assert parents.count(trainer) == fanout, f"the trainer feeds {parents.count(trainer)} relays: {where}"
        before = dict(sender.bytes_sent)
        for version in list(range(1, 11)) + [20]:
            set_all(weights, version)
            store.publish(weights, version=version)
            time.sleep(0.02)
        seen = _wait_versions(relays, 20)
        sent = sum(sender.bytes_sent.values()) - sum(before.values())
    for host, published in enumerate(seen):
        versions = [v for v, _ in published]
        assert versions[-1] == 20 and versions == sorted(set(versions)), f"host {host}: {published}"
        assert set(versions) <= {0, *range(1, 11), 20}, f"host {host} published another number: {versions}"
        assert all(whole for _, whole in published), f"host {host} published a mix of versions: {published}"
    assert sent <= fanout * 11 * (store.nbytes + 64 * 1024), f"the trainer sent {sent} bytes for 11 publishes"
    for relay in relays:
        relay.expect("done")


def test_a_killed_middle_relay_cuts_off_only_the_hosts_below_which_reattach_and_catch_up(
    store_factory, start, tmp_path
):
    big = {"a": 3_000_000, "b": 7}  # 12 MB: a version is in flight along the chain for a while
    weights = blob_weights(big, 0.0)
    store = store_factory(weights)
    hosts = _hosts(tmp_path, 4)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, fanout=1, bucket_bytes=1 << 20) as sender:
        relays, where = _grow(start, sender, hosts)  # a chain: trainer -> 0 -> 1 -> 2 -> 3
        version = 0
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:  # publish flat out: the chain is always forwarding
            version += 1
            set_all(weights, version)
            store.publish(weights)
        os.kill(relays[1].pid, signal.SIGKILL)
        relays[1].proc.join(10)
        # Hosts 2 and 3 lose their parent and go back to the trainer, which points them at a
        # relay with room: host 2 under host 0, host 3 stays under host 2.
        (parent, _) = relays[2].expect("attached", timeout=60)
        assert tuple(parent) == where[0][1], f"host 2 re-attached under {parent}, not host 0"
        for _ in range(3):
            version += 1
            set_all(weights, version)
            store.publish(weights)
        seen = _wait_versions([relays[0], relays[2], relays[3]], version)
    for host, published in zip((0, 2, 3), seen):
        versions = [v for v, _ in published]
        assert versions[-1] == version, f"host {host} did not catch up: {versions[-5:]}"
        assert versions == sorted(set(versions)) and all(whole for _, whole in published), (host, published)
    for i in (0, 2, 3):
        relays[i].expect("done")


def test_a_stalled_middle_relay_holds_up_only_the_hosts_below_it(store_factory, start, tmp_path):
    weights = blob_weights(SIZES, 0.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, fanout=1, bucket_bytes=256 << 10) as sender:
        relays, where = _grow(start, sender, _hosts(tmp_path, 4))  # trainer -> 0 -> 1 -> 2 -> 3
        parents = [parent for parent, _ in where]
        assert parents[1:] == [serving for _, serving in where[:-1]], f"not a chain: {where}"
        os.kill(relays[1].pid, signal.SIGSTOP)
        try:
            slowest = _slowest_publish(store, weights, 40, gap=0.005)
            (first,) = _wait_versions([relays[0]], 40)
            assert first[-1][0] == 40, "the host above the stalled relay fell behind the trainer"
            assert slowest < 0.25, f"a publish took {slowest:.3f}s while a relay was stalled"
            below = [_versions(r)[-1][0] for r in relays[2:]]
            assert max(below) < 40, f"the hosts below a stalled relay kept up: {below}"
        finally:
            os.kill(relays[1].pid, signal.SIGCONT)
        seen = _wait_versions(relays, 40)  # resumed: everyone catches up, latest first
    for host, published in enumerate(seen):
        assert published[-1][0] == 40 and all(whole for _, whole in published), (host, published)
    assert len(seen[3]) < 41, "the hosts below were sent every version instead of the newest"
    for relay in relays:
        relay.expect("done")


# -- a peer that holds the secret, gone wrong ------------------------------------------------------
def _joining(port, serve=None, node=None):
    """A link that joined the trainer as a relay would (JOIN sent); returns it and its node id."""
    node = node or os.urandom(8).hex()
    link = wire.connect("127.0.0.1", port, SECRET.encode(), 5)
    link.send_json(b"JOIN", {"node": node, "serve": serve})
    return link, node


def _admitted(link, have):
    """Take the layout and the tree's settings, then answer HAVE ``have``; the settings."""
    kind, _ = link.recv_frame({b"LYOT": 64 << 20}, 5)
    link.recv_payload(5)
    _, conf = link.recv_json({b"CONF": 4096}, 5)
    link.send_json(b"HAVE", {"version": have})
    return conf


def _free_port():
    import socket as socket_module

    with socket_module.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_relays_are_pointed_only_where_a_relay_proved_it_serves(store_factory, start, host):
    """A relay holding the secret that announces an address nobody (or a stranger) serves at, on
    every link it takes, fills the trainer's fan-out; later relays are never sent there."""
    store = store_factory(blob_weights(SIZES, 1.0))
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, fanout=2) as sender:
        nowhere = ("127.0.0.1", _free_port())
        bad = [_joining(sender.port, serve=list(nowhere))[0] for _ in range(2)]
        for link in bad:
            _admitted(link, -1)
        wait_for(lambda: len(sender.relays) == 2, what="the two links to be admitted")
        relay = start_relay(start, host, sender.port)
        began = time.monotonic()  # from the relay process being up: its start-up is no part of the join
        wait_for(lambda: len(sender.relays) == 3, timeout=30, what="the real relay to be admitted here")
        assert time.monotonic() - began < 10
        wait_for(lambda: 3 in sender.serving, what="the real relay's address to be checked")
        assert nowhere not in sender.serving.values(), f"an address nobody proved is handed out: {sender.serving}"
        for link in bad:
            link.close()
    relay.expect("done")


def test_a_relay_found_in_its_own_tree_path_gives_up_in_bounded_time(one_host):
    layout, _ = _description()

    def script(link, attempt):
        _admit(link, layout, path=["0123456789abcdef", fake.joined["node"]])  # a cycle, every time
        link.sock.recv(1)

    fake = FakeTrainer(script)
    began = time.monotonic()
    error, _ = _relay_against(fake, one_host, timeout=2.0)
    assert type(error).__name__ == "TrainerGoneError" and "cycle" in str(error), _chain(error)
    assert time.monotonic() - began < 6, f"it took {time.monotonic() - began:.1f} s to give up"
    assert os.listdir(one_host) == []


def test_nobody_joins_under_the_trainers_node_id_or_twice_under_one_and_relays_are_never_pointed_back(
    store_factory, start, host
):
    """A holder of the secret learns the trainer's node id from the tree's settings, joins under
    it announcing the trainer's own address (which would answer the address check as that id),
    and joins twice under one id: each is refused, and a real relay still joins and is never
    pointed back at the trainer."""
    store = store_factory(blob_weights(SIZES, 1.0))
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, fanout=1) as sender:
        first, node = _joining(sender.port, serve=list(("127.0.0.1", _free_port())))
        trainer = _admitted(first, -1)["path"][-1]
        wait_for(lambda: len(sender.relays) == 1, what="the first link to be admitted")
        for claimed in (trainer, node):
            link, _ = _joining(sender.port, serve=["127.0.0.1", sender.port], node=claimed)
            assert link.sock.recv(1) == b"", f"a link joined under the taken id {claimed}"
            link.close()
        wait_for(lambda: sender.refused == 2, what="both to be refused")
        assert len(sender.relays) == 1 and ("127.0.0.1", sender.port) not in sender.serving.values()
        relay = start_relay(start, host, sender.port)
        wait_for(lambda: len(sender.relays) == 2, timeout=30, what="the real relay to be admitted")
        wait_for(lambda: sender.relays.get(2) == store.version, what="it to take the version")
        first.close()
    relay.expect("done")


def test_a_relay_pointed_round_a_circle_asks_the_trainer_and_is_taken_on_directly(one_host):
    layout, nbytes = _description()
    joins = []

    def script(link, attempt):
        joins.append(fake.joined)
        if not fake.joined.get("direct"):
            link.send_json(b"REDI", {"to": ["127.0.0.1", fake.port]})  # back to the trainer: a circle
            return
        _admit(link, layout)
        _version(link, 1, nbytes, [b"\x01" * nbytes])
        link.send(b"STOP")

    fake = FakeTrainer(script)
    error, snap = _relay_against(fake, one_host, timeout=10)
    assert error is None, _chain(error)
    assert [bool(j.get("direct")) for j in joins] == [False, True]
    assert snap.version == 1


@pytest.mark.parametrize("have", [5, 1 << 62])
def test_a_relay_claiming_a_version_above_the_trainers_is_refused_and_holds_no_place(store_factory, have):
    store = store_factory(blob_weights(SIZES, 1.0))
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, fanout=1) as sender:
        link, _ = _joining(sender.port)
        _admitted(link, have)
        assert link.sock.recv(1) == b"", "a relay claiming a version above the trainer's kept its link"
        wait_for(lambda: sender.refused == 1, what="it to be refused")
        assert sender.relays == {}
        ok, _ = _joining(sender.port)
        _admitted(ok, 0)
        wait_for(lambda: len(sender.relays) == 1, what="the next relay to take the place")
        ok.close()


def test_a_stalled_relay_is_dropped_after_the_timeout_and_its_place_and_address_freed(store_factory, start, tmp_path):
    hosts = _hosts(tmp_path, 2)
    weights = blob_weights(SIZES, 0.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, fanout=1, timeout=3.0, bucket_bytes=64 << 10) as sender:
        first = start_relay(start, hosts[0], sender.port)
        wait_for(lambda: sender.relays.get(1, -1) >= 0 and 1 in sender.serving, what="the first relay to link")
        os.kill(first.pid, signal.SIGSTOP)
        try:
            began = time.monotonic()
            while 1 in sender.relays and time.monotonic() - began < 30:
                _slowest_publish(store, weights, 5, gap=0.05)
            took = time.monotonic() - began
            assert 1 not in sender.relays and "took no bytes" in sender.dropped.get(1, ""), sender.dropped
            assert took < 3.0 + 5.0, f"the stalled relay was dropped after {took:.1f} s"
            assert sender.serving == {}, "a dropped relay's address is still handed out"
            second = start_relay(start, hosts[1], sender.port)
            wait_for(lambda: 2 in sender.relays, what="a new relay to take the freed place")
            _slowest_publish(store, weights, 3)
            wait_for(lambda: sender.relays[2] == store.version, what="the new relay to get the newest version")
        finally:
            os.kill(first.pid, signal.SIGKILL)
    second.expect("done")


@pytest.mark.timeout(180)
def test_stalled_relays_hold_no_copy_of_the_weights(store_factory, start):
    """Twelve relays that join and never read, a 16 MiB model: the trainer keeps at most a bucket
    per link, never a copy of the model per link (it grew by 243 MiB when each kept one); what
    every link sends from is the newest version sealed once, and a buffer for the next."""
    import psutil

    big = {"a": 4_000_000, "b": 7}  # 16 MB
    weights = blob_weights(big, 0.0)
    store = store_factory(weights)
    me = psutil.Process()
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, bucket_bytes=256 << 10, fanout=64) as sender:
        stallers = start(helpers.join_and_stall, sender.port, SECRET, 12)
        stallers.expect("stalling", timeout=60)
        wait_for(lambda: len(sender.relays) == 12, what="the twelve to be admitted")
        before = me.memory_info().rss
        for v in range(1, 6):
            set_all(weights, v)
            store.publish(weights)
            time.sleep(0.3)
        grown = me.memory_info().rss - before
        assert grown < 48 << 20, f"the trainer grew by {grown >> 20} MiB with 12 stalled links"
        assert _slowest_publish(store, weights, 5) < 0.5


def test_the_relays_dropped_are_remembered_at_most_256(store_factory):
    store = store_factory(blob_weights(SIZES, 1.0))
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        for _ in range(300):
            link, _ = _joining(sender.port)
            link.recv_frame({b"LYOT": 64 << 20}, 5)
            link.recv_payload(5)
            link.recv_json({b"CONF": 4096}, 5)
            link.send_json(b"MISM", {"why": "another model"})
            link.sock.recv(1)
            link.close()
        wait_for(lambda: sender.refused + len(sender.dropped) > 0 and len(sender.dropped) == 256, what="the cap")


def test_refused_connections_are_logged_at_a_rate_limit(store_factory, caplog):
    store = store_factory(blob_weights(SIZES, 1.0))
    logged = caplog.at_level("WARNING", logger="shmsync.relay")
    with logged, RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        for _ in range(200):
            _stranger(sender.port)
        wait_for(lambda: sender.refused == 200, what="every stranger to be refused")
    lines = [r for r in caplog.records if r.name == "shmsync.relay"]
    assert 1 <= len(lines) <= 12, f"{len(lines)} log lines for 200 refusals"


def _command(port, host, *extra):
    env = {**os.environ, "SHMSYNC_DIR": host, "SHMSYNC_RELAY_SECRET": SECRET}
    cmd = [sys.executable, "-m", "shmsync.workers.relay", "--connect", f"127.0.0.1:{port}", "--store", "policy"]
    return subprocess.run([*cmd, "--timeout", "3", *extra], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "hostile, code, match",
    [
        ("a version inside a version", 6, r"ProtocolError: .*sent a b'VERS' message where only"),
        ("a layout of 2**61 bytes", 6, r"past 1099511627776"),
        ("the largest version", 6, r"sent version 9223372036854775807"),
        ("a frame altered on the way", 5, r"AuthenticationError: .*failed its check"),
    ],
)
def test_the_relay_command_ends_each_protocol_error_with_its_code_and_one_line(host, hostile, code, match):
    layout, nbytes = _description()

    def script(link, attempt):
        if hostile == "a layout of 2**61 bytes":
            doc = json.loads(layout)
            doc["entries"][-1][1], doc["entries"][-1][4] = [1 << 59], 1 << 61
            link.send(b"LYOT", json.dumps(doc).encode())
        elif hostile == "a frame altered on the way":
            link.sock.sendall(wire.FRAME.pack(b"LYOT", len(layout)) + layout + b"\0" * 16)
        else:
            _admit(link, layout)
            if hostile == "the largest version":
                _version(link, (1 << 63) - 1, nbytes, [b"x" * nbytes])
            else:
                _version(link, 1, nbytes, [b"x" * 4096])
                _version(link, 2, nbytes, [])
        link.sock.recv(1)

    fake = FakeTrainer(script)
    try:
        proc = _command(fake.port, host)
    finally:
        fake.close()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr and len([x for x in lines if x.startswith("relay:")]) == 1, proc.stderr
    assert re.search(match, lines[-1]), lines[-1]
    assert os.listdir(host) == []


def test_the_relay_command_never_takes_a_secret_on_its_command_line(host):
    proc = _command(1, host, "--secret", "a secret typed where everyone sees it")
    assert proc.returncode == 2 and "a secret typed" not in proc.stderr + proc.stdout
    assert "--secret-file" in proc.stderr
    short = subprocess.run(
        [sys.executable, "-m", "shmsync.workers.relay", "--connect", "127.0.0.1:1", "--store", "policy"],
        env={**os.environ, "SHMSYNC_RELAY_SECRET": "passwordpassword"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert short.returncode == 2 and "32 to 4096 random bytes" in short.stderr
    assert "passwordpassword" not in short.stderr


def _relay_command(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "shmsync.workers.relay", *args], env=env, capture_output=True, text=True, timeout=60
    )


def test_the_relay_command_without_a_secret_says_how_to_give_one():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMSYNC_RELAY_SECRET")}
    proc = _relay_command("--connect", "127.0.0.1:1", "--store", "policy", env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "--secret-file FILE" in line and "$SHMSYNC_RELAY_SECRET" in line and "secret=" not in line


@pytest.mark.parametrize("command", ["relay", "launch"])
def test_each_commands_help_describes_it_in_whole_sentences(command):
    proc = subprocess.run(
        [sys.executable, "-m", f"shmsync.workers.{command}", "--help"], capture_output=True, text=True, timeout=60
    )
    description = " ".join(proc.stdout.split("\n\n")[1].split())  # after the usage lines
    assert proc.returncode == 0 and description.endswith(".") and ":mod:" not in description, description


def test_the_trainers_table_lists_every_hosts_readers_and_marks_a_lost_host(store_factory, start, host, tmp_path):
    weights = blob_weights(SIZES, 0.0)
    store = store_factory(weights, name=f"relayed-{os.getpid()}")
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        relay = start(helpers.run_relay, host, sender.port, "policy", None, None)
        relay.expect("started")
        reader = start(helpers.follow_as_worker, host, "policy", SIZES, 4)
        (pid,) = reader.expect("attached")
        for version in (1, 2, 3):
            set_all(weights, version)
            store.publish(weights)
            published = time.monotonic()
            wait_for(
                lambda: (
                    [(r.pid, r.worker, r.version) for r in store.readers() if r.report_age_s is not None]
                    == [(pid, 4, store.version)]
                ),
                timeout=10,
                what=f"the remote reader at version {store.version} in the trainer's table",
            )
            assert time.monotonic() - published < 2.0 + 1.0, "the remote reader showed up late"
        table = store.readers()
        (remote,) = [r for r in table if r.report_age_s is not None]
        assert remote.store == "policy" and remote.state in ("sleeping", "running") and remote.behind == 0
        assert [(h.via, h.state, h.readers) for h in table.hosts] == [("relay 1", "reporting", 1)]

        # Another process on the trainer's host sees them too, once the report file is next
        # rewritten (at most once a second, so it may trail the trainer's own table by a report).
        def remote_in_cli() -> list:
            doc = json.loads(cli("ls", store.name, "--json").stdout)
            return [(r["pid"], r["worker"], r["version"]) for r in doc["readers"] if r["report_age_s"] is not None]

        wait_for(lambda: remote_in_cli() == [(pid, 4, 3)], timeout=10, what="the remote reader at 3 in `shmsync ls`")
        relay.proc.kill()
        relay.proc.join(10)
        killed = time.monotonic()
        wait_for(lambda: store.readers().gone, timeout=10, what="the lost host's rows to be marked")
        assert time.monotonic() - killed < 3.0
        table = store.readers()
        assert [(r.pid, r.state) for r in table.gone] == [(pid, "lost")] and not table.rows
        assert [h.state for h in table.hosts] == ["lost"] and "no report from" in table.summary()
    assert not os.path.exists(f"/dev/shm/shmsync-{store.name}~hosts"), "the report file outlived the sender"


@pytest.mark.parametrize(
    "report",
    [
        b"not json",
        json.dumps({"hosts": [["h", "0123456789abcdef", "policy", -1.0, []]]}).encode(),
        json.dumps(
            {"hosts": [["h", "0123456789abcdef", "policy", 0.0, [[0, 0, 0, 0, 0, 0, False, "", None]]]]}
        ).encode(),
    ],
)
def test_a_relay_whose_report_fails_its_check_is_cut_and_listed_nowhere(store_factory, report):
    store = store_factory(blob_weights(SIZES, 1.0))
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        link, _ = _joining(sender.port)
        _admitted(link, 0)
        wait_for(lambda: 1 in sender.relays, what="the link to be admitted")
        link.send(b"RPRT", report)
        link.sock.settimeout(10)
        while link.sock.recv(65536):
            pass  # until the sender hangs up
        assert not [r for r in store.readers() if r.report_age_s is not None] and not store.readers().hosts
