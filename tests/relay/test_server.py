"""A relay port (shmsync/relay/server.py and acceptor.py): strangers, floods and stalled or lying
relays are refused or dropped in bounded time and memory, while real relays still join and the
trainer publishes on; relays are pointed only where a relay proved it serves. Each claim is a
handshake or a count: a peer that stalls or floods does so until the test ends, so that a trainer
or a server that waited on it would hang, which the deadlines catch; none times a call."""

from __future__ import annotations

import os
import signal
import time

import pytest

from shmsync.relay import RelaySender, wire
from tests.relay import peers
from tests.relay.peers import (
    SECRET,
    SIZES,
    admitted,
    host_dirs,
    join_as_relay,
    slowest_publish,
    start_relay,
)
from tests.waiting import STUCK_S, wait_for
from tests.weights import blob_weights, set_all

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(120)]


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


def test_a_stranger_gets_a_nonce_and_a_refusal_only_and_the_trainer_publishes_on(store_factory, start, host):
    weights = blob_weights(SIZES, 1.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        slowest_publish(store, weights)
        got = _stranger(sender.port)
        assert got[wire.SERVER_HELLO :] == bytes([wire.REFUSED]), "a peer without the secret was sent more"
        wait_for(lambda: sender.refused == 1, what="the stranger to be refused")
        # A real relay still links, and the trainer publishes as before.
        relay = start_relay(start, host, sender.port)
        wait_for(lambda: sender.relays.get(1, -1) == store.version, what="the real relay to link")
        slowest_publish(store, weights)
        wait_for(lambda: sender.relays[1] == store.version, what="the relay to take every version")
        assert sender.dropped == {}
    relay.expect("done")


def _joins_through_the_flood(start, host, sender):
    """A relay for ``host``, joined while the flood goes on (it floods until killed: a server that
    gave its places to the flood alone would never let the relay in)."""
    relay = start_relay(start, host, sender.port)
    wait_for(lambda: 1 in sender.relays, timeout=STUCK_S, what="a real relay to get past the flood")
    return relay


@pytest.mark.timeout(120)
def test_a_relay_joins_while_1000_connections_stall_mid_handshake_or_reconnect_in_a_loop(store_factory, start, host):
    import threading

    weights = blob_weights(SIZES, 1.0)
    store = store_factory(weights)
    threads_before = threading.active_count()
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        flood = start(peers.flood, sender.port, 1000)
        flood.expect("flooding", timeout=60)  # 1000 open, half silent, half cut off mid-hello; a loop reconnects
        wait_for(lambda: sender.refused >= 1000, timeout=30, what="the flood's connections to be cut")
        relay = _joins_through_the_flood(start, host, sender)
        assert threading.active_count() <= threads_before + 8, "threads grew with the connections"
        slowest_publish(store, weights)  # the flood goes on: a publish that waited on it would hang
        wait_for(lambda: sender.relays[1] == store.version, what="the relay to take every version")
        flood.proc.kill()
        began = time.monotonic()
    assert time.monotonic() - began < STUCK_S, "close() waited on the flood's connections"
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
def test_a_relay_joins_while_a_flood_trickles_bytes_on_every_handshake_place(
    store_factory, start, host, few_descriptors
):
    """Every handshake place is taken by a connection that sends a byte now and then and never
    finishes, and a new one comes every 10 ms: the relay's own handshake must not be the one cut."""
    weights = blob_weights(SIZES, 1.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        flood = start(peers.trickle, sender.port, 300)
        flood.expect("flooding", timeout=60)
        wait_for(lambda: sender.refused >= 50, timeout=30, what="the places to fill and handshakes to be cut")
        relay = _joins_through_the_flood(start, host, sender)
        wait_for(lambda: sender.relays.get(1) == store.version, what="the relay to take the version")
        flood.proc.kill()
    relay.expect("done")


def test_a_silent_connection_is_cut_for_its_silence_long_before_the_handshake_timeout(store_factory, caplog):
    import socket as socket_module

    store = store_factory(blob_weights(SIZES, 1.0))
    # A handshake timeout no test waits out: the connection can only be cut for its silence.
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, handshake_timeout=10 * STUCK_S) as sender:
        sock = socket_module.create_connection(("127.0.0.1", sender.port), timeout=STUCK_S)
        assert len(sock.recv(4096)) == wire.SERVER_HELLO
        assert sock.recv(1) == b"", "the server kept a silent connection"
        sock.close()
        wait_for(lambda: sender.refused == 1, what="the silent connection to be counted")
    assert any("silent for" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


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
        slowest_publish(store, weights)
        assert sender.relays == {}


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
        bad = [join_as_relay(sender.port, serve=list(nowhere))[0] for _ in range(2)]
        for link in bad:
            admitted(link, -1)
        wait_for(lambda: len(sender.relays) == 2, what="the two links to be admitted")
        relay = start_relay(start, host, sender.port)
        wait_for(lambda: len(sender.relays) == 3, timeout=STUCK_S, what="the real relay to be admitted here")
        wait_for(lambda: 3 in sender.serving, what="the real relay's address to be checked")
        assert nowhere not in sender.serving.values(), f"an address nobody proved is handed out: {sender.serving}"
        for link in bad:
            link.close()
    relay.expect("done")


def test_nobody_joins_under_the_trainers_node_id_or_twice_under_one_and_relays_are_never_pointed_back(
    store_factory, start, host
):
    """A holder of the secret learns the trainer's node id from the tree's settings, joins under
    it announcing the trainer's own address (which would answer the address check as that id),
    and joins twice under one id: each is refused, and a real relay still joins and is never
    pointed back at the trainer."""
    store = store_factory(blob_weights(SIZES, 1.0))
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, fanout=1) as sender:
        first, node = join_as_relay(sender.port, serve=list(("127.0.0.1", _free_port())))
        trainer = admitted(first, -1)["path"][-1]
        wait_for(lambda: len(sender.relays) == 1, what="the first link to be admitted")
        for claimed in (trainer, node):
            link, _ = join_as_relay(sender.port, serve=["127.0.0.1", sender.port], node=claimed)
            assert link.sock.recv(1) == b"", f"a link joined under the taken id {claimed}"
            link.close()
        wait_for(lambda: sender.refused == 2, what="both to be refused")
        assert len(sender.relays) == 1 and ("127.0.0.1", sender.port) not in sender.serving.values()
        relay = start_relay(start, host, sender.port)
        wait_for(lambda: len(sender.relays) == 2, timeout=30, what="the real relay to be admitted")
        wait_for(lambda: sender.relays.get(2) == store.version, what="it to take the version")
        first.close()
    relay.expect("done")


@pytest.mark.parametrize("have", [5, 1 << 62])
def test_a_relay_claiming_a_version_above_the_trainers_is_refused_and_holds_no_place(store_factory, have):
    store = store_factory(blob_weights(SIZES, 1.0))
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, fanout=1) as sender:
        link, _ = join_as_relay(sender.port)
        admitted(link, have)
        assert link.sock.recv(1) == b"", "a relay claiming a version above the trainer's kept its link"
        wait_for(lambda: sender.refused == 1, what="it to be refused")
        assert sender.relays == {}
        ok, _ = join_as_relay(sender.port)
        admitted(ok, 0)
        wait_for(lambda: len(sender.relays) == 1, what="the next relay to take the place")
        ok.close()


def test_a_stalled_relay_is_dropped_after_the_timeout_and_its_place_and_address_freed(store_factory, start, tmp_path):
    hosts = host_dirs(tmp_path, 2)
    weights = blob_weights(SIZES, 0.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, fanout=1, timeout=3.0, bucket_bytes=64 << 10) as sender:
        first = start_relay(start, hosts[0], sender.port)
        wait_for(lambda: sender.relays.get(1, -1) >= 0 and 1 in sender.serving, what="the first relay to link")
        os.kill(first.pid, signal.SIGSTOP)  # stopped until the test ends: kept, it would stay forever
        try:
            began = time.monotonic()
            while 1 in sender.relays and time.monotonic() - began < STUCK_S:
                slowest_publish(store, weights, 5, gap=0.05)
            assert 1 not in sender.relays and "took no bytes" in sender.dropped.get(1, ""), sender.dropped
            assert sender.serving == {}, "a dropped relay's address is still handed out"
            second = start_relay(start, hosts[1], sender.port)
            wait_for(lambda: 2 in sender.relays, what="a new relay to take the freed place")
            slowest_publish(store, weights, 3)
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
        stallers = start(peers.join_and_stall, sender.port, SECRET, 12)
        stallers.expect("stalling", timeout=60)
        wait_for(lambda: len(sender.relays) == 12, what="the twelve to be admitted")
        before = me.memory_info().rss
        for v in range(1, 6):
            set_all(weights, v)
            store.publish(weights)
            time.sleep(0.3)
        grown = me.memory_info().rss - before
        assert grown < 48 << 20, f"the trainer grew by {grown >> 20} MiB with 12 stalled links"
        slowest_publish(store, weights, 5)  # the links stall until the test ends: a publish that waited would hang
        assert store.version == 10


def test_the_relays_dropped_are_remembered_at_most_256(store_factory):
    store = store_factory(blob_weights(SIZES, 1.0))
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        for _ in range(300):
            link, _ = join_as_relay(sender.port)
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
