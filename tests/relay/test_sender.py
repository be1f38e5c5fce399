"""The trainer's side (shmsync/relay/sender.py): RelaySender never waits for a host, shapes its
tree by the version's size, and closes in bounded time whatever its relays do."""

from __future__ import annotations

import os
import signal
import time

import pytest

from shmsync.relay import RelaySender
from tests.relay.peers import SECRET, SIZES, slowest_publish, start_relay
from tests.waiting import STUCK_S, wait_for
from tests.weights import blob_weights, set_all

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(120)]


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
            slowest_publish(store, weights, 40, gap=0.005)  # a publish that waited on the stalled host would hang
            wait_for(lambda: max(sender.relays.values()) == 40, what="the running host to get version 40")
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


@pytest.mark.timeout(2 * STUCK_S)
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
        assert time.monotonic() - began < STUCK_S, "close() waited on a stalled relay"
    finally:
        os.kill(relay.pid, signal.SIGCONT)
    kind, *rest = relay.conn.recv() if relay.conn.poll(60) else ("silent",)
    assert kind in ("done", "error"), kind  # it ends either way, and never publishes a cut version
