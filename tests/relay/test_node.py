"""A relay on its host (shmsync/relay/node.py): it joins the trainer's tree, publishes every
version it receives into its host's store, attaches again after a cut, and never publishes a
version it did not receive whole. Each host is a process with a store folder of its own."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from shmsync.relay import RelaySender
from tests.commands import cli
from tests.relay import peers
from tests.relay.fakes import FakeTrainer, admit, chain, description, relay_against, send_version
from tests.relay.peers import SECRET, SIZES, host_dirs, slowest_publish, start_relay
from tests.waiting import STUCK_S, wait_for
from tests.weights import blob_weights, set_all

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(120)]


def test_a_relay_publishes_the_trainers_versions_on_its_host(store_factory, start, host):
    weights = blob_weights(SIZES, 0.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, bucket_bytes=256 << 10) as sender:
        relay = start_relay(start, host, sender.port)
        reader = start(peers.follow, host, "policy", SIZES, 20)
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
        reader = start(peers.follow, host, "policy", SIZES, 7)
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
    trainer = start(peers.trainer, SIZES)
    name, port = trainer.expect("ready")
    relay = start_relay(start, host, port)
    trainer.expect("linked", timeout=60)
    os.kill(trainer.pid, signal.SIGKILL)
    kind, message, *_ = relay.expect("error", timeout=STUCK_S)
    assert kind == "TrainerGoneError", message
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
        reader = start(peers.follow, host, "policy", big, 0)
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


def _grow(start, sender, hosts):
    """A tree relay per host, started one after the other (so the tree's shape is known):
    returns the relays and, per relay, the address it receives from and the one it serves."""
    relays, where = [], []
    for host in hosts:
        relay = start(peers.tree_relay, host, sender.port, "policy")
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
        relays, where = _grow(start, sender, host_dirs(tmp_path, 4))
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


@pytest.mark.full  # trees beyond the one that grows, feeds and loses no version
def test_a_killed_middle_relay_cuts_off_only_the_hosts_below_which_reattach_and_catch_up(
    store_factory, start, tmp_path
):
    big = {"a": 3_000_000, "b": 7}  # 12 MB: a version is in flight along the chain for a while
    weights = blob_weights(big, 0.0)
    store = store_factory(weights)
    hosts = host_dirs(tmp_path, 4)
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


@pytest.mark.full  # trees beyond the one that grows, feeds and loses no version
def test_a_stalled_middle_relay_holds_up_only_the_hosts_below_it(store_factory, start, tmp_path):
    weights = blob_weights(SIZES, 0.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, fanout=1, bucket_bytes=256 << 10) as sender:
        relays, where = _grow(start, sender, host_dirs(tmp_path, 4))  # trainer -> 0 -> 1 -> 2 -> 3
        parents = [parent for parent, _ in where]
        assert parents[1:] == [serving for _, serving in where[:-1]], f"not a chain: {where}"
        os.kill(relays[1].pid, signal.SIGSTOP)
        try:
            slowest_publish(store, weights, 40, gap=0.005)  # a publish that waited on the stalled relay would hang
            (first,) = _wait_versions([relays[0]], 40)
            assert first[-1][0] == 40, "the host above the stalled relay fell behind the trainer"
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


def test_a_relay_found_in_its_own_tree_path_gives_up_in_bounded_time(one_host):
    layout, _ = description()

    def script(link, attempt):
        admit(link, layout, path=["0123456789abcdef", fake.joined["node"]])  # a cycle, every time
        link.sock.recv(1)

    fake = FakeTrainer(script)
    began = time.monotonic()
    error, _ = relay_against(fake, one_host, timeout=2.0)
    assert type(error).__name__ == "TrainerGoneError" and "cycle" in str(error), chain(error)
    assert time.monotonic() - began < STUCK_S, f"it took {time.monotonic() - began:.1f} s to give up"
    assert os.listdir(one_host) == []


def test_a_relay_pointed_round_a_circle_asks_the_trainer_and_is_taken_on_directly(one_host):
    layout, nbytes = description()
    joins = []

    def script(link, attempt):
        joins.append(fake.joined)
        if not fake.joined.get("direct"):
            link.send_json(b"REDI", {"to": ["127.0.0.1", fake.port]})  # back to the trainer: a circle
            return
        admit(link, layout)
        send_version(link, 1, nbytes, [b"\x01" * nbytes])
        link.send(b"STOP")

    fake = FakeTrainer(script)
    error, snap = relay_against(fake, one_host, timeout=10)
    assert error is None, chain(error)
    assert [bool(j.get("direct")) for j in joins] == [False, True]
    assert snap.version == 1
