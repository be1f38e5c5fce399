"""The relay: a trainer's versions published on other hosts, each host a process with its own
store directory, linked over torch.distributed (gloo) on loopback."""

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

from shmsync import _wire
from shmsync.relay import RelaySender

import helpers
from helpers import SECRET, blob_weights, cli, set_all, wait_for

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
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, bucket_bytes=256 << 10) as sender:
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
def _stranger(port, secret=b"not the relay secret, but long", speak=True):
    """Connect as someone who does not hold the secret; returns every byte the server sent."""
    import socket as socket_module

    sock = socket_module.create_connection(("127.0.0.1", port), timeout=10)
    got = b""
    try:
        while len(got) < len(_wire.MAGIC) + 32:
            got += sock.recv(4096)
        if speak:
            ours = os.urandom(32)
            sock.sendall(_wire.MAGIC + ours + _wire._mac(secret, b"client", got[len(_wire.MAGIC) :], ours))
            while chunk := sock.recv(65536):
                got += chunk
    finally:
        sock.close()
    return got


def test_a_stranger_gets_a_nonce_and_nothing_else_and_the_trainer_keeps_its_pace(store_factory, start, host):
    weights = blob_weights(SIZES, 1.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        calm = _slowest_publish(store, weights)
        got = _stranger(sender.port)
        assert len(got) == len(_wire.MAGIC) + 32, "a peer without the secret was sent more than the nonce"
        wait_for(lambda: sender.refused == 1, what="the stranger to be refused")
        # A real relay still links, and the trainer publishes as before.
        relay = start_relay(start, host, sender.port)
        wait_for(lambda: sender.relays.get(1, -1) == store.version, what="the real relay to link")
        assert _slowest_publish(store, weights) < max(0.1, 20 * calm)
        assert sender.dropped == {}
    relay.expect("done")


@pytest.mark.timeout(90)
def test_a_flood_of_silent_and_garbage_connections_neither_grows_the_trainer_nor_locks_relays_out(
    store_factory, start, host
):
    import socket as socket_module
    import threading

    weights = blob_weights(SIZES, 1.0)
    store = store_factory(weights)
    threads_before = threading.active_count()
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, handshake_timeout=2.0) as sender:
        flood = []
        for i in range(80):
            sock = socket_module.create_connection(("127.0.0.1", sender.port), timeout=10)
            if i % 2:
                sock.sendall(os.urandom(4096))
            flood.append(sock)
        wait_for(lambda: sender.refused >= 80 - 16, what="the connections beyond 16 to be refused")
        assert threading.active_count() <= threads_before + 2 + 16, "a handshake thread per connection"
        relay = start_relay(start, host, sender.port)
        wait_for(lambda: 1 in sender.relays, timeout=45, what="a real relay to get past the flood")
        assert _slowest_publish(store, weights) < 0.25
        for sock in flood:
            sock.close()
        began = time.monotonic()
    assert time.monotonic() - began < 3.0, "close() took too long"
    relay.expect("done")


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
            _wire.FRAME.pack(b"JOIN", 1 << 40),  # a huge announced size: refused before any allocation
            _wire.FRAME.pack(b"VERS", 16) + b"\0" * 16,  # not what comes first
            _wire.FRAME.pack(b"JOIN", 9) + b'{"node":1',  # not JSON
            _wire.FRAME.pack(b"JOIN", 26) + b'{"node":"x","serve":null} ',  # not a node id
        ):
            link = _wire.connect("127.0.0.1", sender.port, SECRET.encode(), 5)
            link.sock.sendall(bad)
            assert link.sock.recv(1) == b"", "the server kept a link that broke the protocol"
            link.close()
        wait_for(lambda: sender.refused == 4, what="each to be dropped")
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
                _wire.server_handshake(sock, self.secret, 5)
                link = _wire.Link(sock, "relay")
                link.recv_json({b"JOIN": 4096}, 5)
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
        return store.layout_description, store.nbytes
    finally:
        store.close()


def _admit(link, description):
    link.send(b"LYOT", description)
    link.send_json(b"CONF", {"fanout": 2, "path": ["0123456789abcdef"]})
    return link.recv_json({b"HAVE": 4096, b"MISM": 4096}, 5)[1]


def _version(link, version, nbytes, pieces):
    import struct

    link.send(b"VERS", struct.pack(">qQ", version, nbytes))
    for piece in pieces:
        link.send(b"DATA", piece)


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
    from shmsync import _segment

    monkeypatch.setattr(_segment, "SHM_DIR", host)  # restored after the test
    return host


@pytest.mark.parametrize(
    "hostile, match",
    [
        ("huge layout", r"LYOT message of 1099511627776 bytes"),
        ("garbage layout", r"not valid JSON"),
        ("bad conf", r"tree's settings"),
        ("short version", r"announced 100 bytes for version 1"),
        ("long piece", r"DATA message of"),
        ("empty piece", r"empty piece"),
        ("a version inside a version", r"sent a b'VERS' message where only"),
        ("negative version", r"sent version -1"),
    ],
)
def test_a_trainer_that_breaks_the_protocol_never_gets_a_byte_published(one_host, hostile, match):
    layout, nbytes = _description()

    def script(link, attempt):
        if hostile == "huge layout":
            link.sock.sendall(_wire.FRAME.pack(b"LYOT", 1 << 40))
        elif hostile == "garbage layout":
            link.send(b"LYOT", b"{" * 100)
        elif hostile == "bad conf":
            link.send(b"LYOT", layout)
            link.send_json(b"CONF", {"fanout": -1, "path": "x"})
        else:
            assert _admit(link, layout) == {"version": -1}
            if hostile == "short version":
                _version(link, 1, 100, [b"x" * 100])
            elif hostile == "long piece":
                _version(link, 1, nbytes, [b"x" * (nbytes + 1)])
            elif hostile == "empty piece":
                _version(link, 1, nbytes, [b""])
            elif hostile == "a version inside a version":
                _version(link, 1, nbytes, [b"x" * 10])
                _version(link, 2, nbytes, [])
            elif hostile == "negative version":
                _version(link, -1, nbytes, [])
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
            _version(link, 4, nbytes, [b"\x04" * 100])
            link.send(b"CNCL")  # cancelled: never published
            _version(link, 5, nbytes, [b"\x05" * 100])  # then the trainer vanishes mid-version
        else:
            assert have == {"version": 3}, "the relay came back holding another version"
            link.send(b"STOP")

    error, snap = _relay_against(FakeTrainer(script), one_host)
    assert error is None, _chain(error)
    assert snap.version == 3 and all(bool((t.view(torch.uint8) == 3).all()) for t in snap.weights.values())


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
