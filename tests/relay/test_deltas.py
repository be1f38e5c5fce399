"""Versions across hosts cost what changed (shmsync/relay/deltas.py): a relay that holds the version
before gets only the leaves that changed, sealed once by the trainer and forwarded untouched; one
that joins, comes back or holds anything else gets the whole version; every host's readers hold the
trainer's bytes exactly; a delta that disagrees with the layout or the version held is refused by
name, and nothing of it is published. Hosts are processes with a store folder each, on loopback."""

from __future__ import annotations

import os
import re
import signal
import struct

import pytest
import torch
from tensordict import TensorDict

from shmsync.errors import ProtocolError
from shmsync.relay import RelaySender, deltas
from tests.commands import cli
from tests.relay import peers
from tests.relay.fakes import FakeTrainer, admit, chain, description, relay_against, send_delta, send_version
from tests.relay.peers import SECRET, host_dirs, weights_digest
from tests.waiting import STUCK_S, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(240)]

SIZES = {"backbone": 1 << 20, "head": 16_384, "norm": 4}  # 4 MiB frozen, 64 KiB trained, a buffer
HEAD_BYTES = SIZES["head"] * 4
HEADERS = 1024  # a version's frames and tags, at most, beside its bytes


# -- the checks of a delta's header ------------------------------------------------------------------
@pytest.mark.parametrize(
    "tail, held, announced, match",
    [
        (deltas.WireDelta(3, (1,), 8).tail(), 4, 8, r"as a delta from version 3, but this host holds version 4"),
        (deltas.WireDelta(-1, (1,), 8).tail(), -1, 8, r"from version -1, but this host holds no version yet"),
        (deltas.WireDelta(4, (0, 9), 8).tail(), 4, 8, r"naming leaf 9 after leaf 0: out of range"),
        (deltas.WireDelta(4, (2, 1), 8).tail(), 4, 8, r"naming leaf 1 after leaf 2: not in increasing order"),
        (deltas.WireDelta(4, (1, 1), 8).tail(), 4, 8, r"naming leaf 1 after leaf 1: not in increasing order"),
        (
            deltas.WireDelta(4, (1,), 8).tail(),
            4,
            9,
            r"announced 9 bytes for the delta of version 5; its 1 leaves hold 8",
        ),
        (deltas.DELTA.pack(4, 3) + struct.pack(">I", 1), 4, 8, r"a delta of 3 leaves in 4 bytes of indices"),
        (deltas.DELTA.pack(4, 1 << 31) + struct.pack(">I", 1), 4, 8, r"a delta of 2147483648 leaves"),
        (b"\0" * 5, 4, 8, r"a delta header of 5 bytes"),
    ],
)
def test_a_delta_header_that_disagrees_with_the_layout_or_the_version_held_is_refused_by_name(
    tail, held, announced, match
):
    with pytest.raises(ProtocolError, match=match):
        deltas.parse(tail, [4, 8, 16, 4], held, 5, announced, "the parent")


def test_a_delta_header_names_its_leaves_in_four_bytes_each_at_most_every_leaf_of_the_layout():
    assert deltas.frame_bytes(56, 3) == (56 + 12, 56 + 12 + 12)
    delta = deltas.WireDelta(7, (0, 2), 20)
    assert deltas.parse(delta.tail(), [4, 8, 16], 7, 8, 20, "p") == delta


# -- a relay against a trainer that sends deltas ---------------------------------------------------
@pytest.mark.parametrize(
    "hostile, match",
    [
        ("a leaf index out of range", r"naming leaf 3 after leaf 0: out of range \(the layout has 3 leaves\)"),
        ("sizes that disagree with the layout", r"announced 100 bytes for the delta of version 2; its 1 leaves hold"),
        ("a base that is not the version held", r"version 2 as a delta from version 0, but this host holds version 1"),
        ("a count that disagrees with its indices", r"a delta of 2 leaves in 4 bytes of indices"),
        ("a delta before any version", r"from version -1, but this host holds no version yet"),
        ("a delta sealed from another base", r"piece 0 of version 2 failed its check"),
        ("a delta sealed with other leaves", r"piece 0 of version 2 failed its check"),
    ],
)
def test_a_hostile_delta_is_refused_by_name_and_nothing_of_it_is_published(one_host, hostile, match):
    layout, nbytes = description()
    sizes = [e[4] for e in __import__("json").loads(layout)["entries"]]
    b = 1  # the leaf of 1,000 floats

    def script(link, attempt):
        assert admit(link, layout) == {"version": -1}
        if hostile == "a delta before any version":
            send_delta(link, 2, -1, [b], sizes[b], b"\x02" * sizes[b])
        else:
            send_version(link, 1, nbytes, [b"\x01" * nbytes])
            if hostile == "a leaf index out of range":
                send_delta(link, 2, 1, [0, 3], sizes[0] + 4, b"\x02" * (sizes[0] + 4))
            elif hostile == "sizes that disagree with the layout":
                send_delta(link, 2, 1, [b], 100, b"\x02" * 100)
            elif hostile == "a base that is not the version held":
                send_delta(link, 2, 0, [b], sizes[b], b"\x02" * sizes[b])
            elif hostile == "a count that disagrees with its indices":
                send_delta(link, 2, 1, [b], sizes[b], b"\x02" * sizes[b], count=2)
            elif hostile == "a delta sealed from another base":
                send_delta(link, 2, 1, [b], sizes[b], b"\x02" * sizes[b], sealed_as=(0, [b]))
            else:  # the same bytes, sealed as a delta of another leaf of that size
                send_delta(link, 2, 1, [b], sizes[b], b"\x02" * sizes[b], sealed_as=(1, [b + 1]))
        link.sock.recv(1)  # until the relay hangs up

    error, snapshot = relay_against(FakeTrainer(script), one_host)
    assert error is not None and re.search(match, chain(error)), chain(error)
    if hostile == "a delta before any version":
        assert snapshot is None and os.listdir(one_host) == []
    else:
        assert snapshot.version == 1
        assert all(bool((t.view(torch.uint8) == 1).all()) for t in snapshot.weights.values()), "a delta leaked in"


def test_a_relay_publishes_a_delta_over_the_version_it_holds(one_host):
    layout, nbytes = description()
    c = 2  # the leaf of 7 floats

    def script(link, attempt):
        assert admit(link, layout) == {"version": -1}
        send_version(link, 1, nbytes, [b"\x01" * nbytes])
        send_delta(link, 3, 1, [c], 28, b"\x03" * 28)  # versions may skip
        link.send(b"STOP")

    error, snapshot = relay_against(FakeTrainer(script), one_host)
    assert error is None, chain(error)
    values = {k: set(t.view(torch.uint8).tolist()) for k, t in snapshot.weights.items()}
    assert snapshot.version == 3 and values == {"a": {1}, "b": {1}, "c": {3}}, values


# -- a tree of relays under a trainer whose backbone is frozen -------------------------------------------
def trainer_weights():
    generator = torch.Generator().manual_seed(0)
    return TensorDict({"backbone": torch.randn(SIZES["backbone"], generator=generator),
                       "head": torch.zeros(SIZES["head"]), "norm": torch.zeros(SIZES["norm"])})  # fmt: skip


def train(weights, version):
    """What a training step does: the head changes, the frozen part not; now and then another part
    changes too, by routes torch's version counter does not see."""
    weights["head"].copy_(torch.randn(SIZES["head"], generator=torch.Generator().manual_seed(version)))
    if version == 5:
        weights["backbone"].data[777] += 1.0
    if version == 9:
        weights["norm"].numpy()[:] = version


class Hosts:
    """The hosts' processes, by index; each version is checked on every live one."""

    def __init__(self, start, dirs, encrypt):
        self.start, self.dirs, self.encrypt, self.port, self.live = start, dirs, encrypt, 0, {}

    def add(self, i):
        self.live[i] = self.start(peers.delta_host, self.dirs[i], self.port, "policy", SIZES, self.encrypt)
        return self.live[i].expect("ready", timeout=120)

    def hold(self, version, digest):
        """Every live host's reader holds ``version``, byte for byte the trainer's; what it cost each."""
        for host in self.live.values():
            host.conn.send(("hold", version))
        costs = {}
        for i, host in self.live.items():
            held, got, transfer = host.expect("holds", timeout=120)
            assert (held, got) == (version, digest), f"host {i} holds version {held}, not the trainer's bytes"
            costs[i] = transfer  # [version, bytes, delta, deltas, wholes, all bytes]
        return costs

    def stop(self):
        for host in self.live.values():
            host.conn.send(("stop",))


@pytest.mark.parametrize("proof, encrypt", [("written pages", True), ("comparison", False)])
def test_a_tree_of_relays_sends_what_changed_and_every_host_holds_the_trainers_bytes(
    store_factory, start, tmp_path, monkeypatch, proof, encrypt
):
    """Under each proof of "unchanged" on the trainer (the pages written, or a comparison of the
    bytes), on sealed links and on plain ones."""
    if proof == "comparison":
        monkeypatch.setenv("SHMSYNC_WRITE_TRACKING", "0")  # the trainer proves leaves unchanged by comparison
    weights = trainer_weights()
    store = store_factory(weights, num_slots=4)
    if store.writer.copy.changes.watch.proof != proof:
        pytest.skip(f"write tracking is unavailable here: {store.writer.copy.changes.watch.why_compared}")
    hosts = Hosts(start, host_dirs(tmp_path, 4), encrypt)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, fanout=2, bucket_bytes=256 << 10, encrypt=encrypt) as sender:
        hosts.port = sender.port
        for i, checked in enumerate((1, 2, 2)):  # the third below one of the first two: its parent forwards
            parent, _ = hosts.add(i)
            wait_for(lambda n=checked: len(sender.serving) == n, what=f"host {i}'s address to be checked")
        assert parent != sender.port, "the third host was not placed below a relay"

        def version(v):
            train(weights, v)
            store.publish(weights, version=v)
            return hosts.hold(v, weights_digest(dict(weights.items())))

        for v in range(1, 7):
            costs = version(v)
            if v >= 2:  # every host held the version before: the delta, the head alone (v 5: and the backbone)
                for i, (_, nbytes, delta, *_) in costs.items():
                    assert delta, f"host {i} got version {v} whole"
                    least = HEAD_BYTES + (4 << 20) * (v == 5)
                    assert least < nbytes < least + HEADERS, f"host {i}: {nbytes} bytes for version {v}"
        assert store.delta_of(6).leaves == (store.memory.layout.index[("head",)],)

        hosts.add(3)  # joins late: its store is made from the whole version 6
        costs = version(7)
        assert costs[3][2] and costs[3][4] == 1, "the late host's first version was not whole, or the next not a delta"

        os.kill(hosts.live[1].pid, signal.SIGKILL)  # a relay dies (and its children re-attach)
        hosts.live.pop(1).proc.join(10)
        version(8)
        version(9)
        hosts.add(1)  # a new relay on that host, whose store holds version 7: behind, so the whole version 9
        costs = hosts.hold(9, weights_digest(dict(weights.items())))
        assert not costs[1][2] and costs[1][1] > 4 << 20, f"the restarted relay got version 9 as {costs[1]}"
        for v in (10, 11):  # and then, like every host, what changed
            costs = version(v)
            assert all(c[2] and HEAD_BYTES < c[1] < HEAD_BYTES + HEADERS for c in costs.values()), costs

        # What the last version cost each host, in the trainer's table and in `shmsync ls NAME`.
        def reported():
            hosts = store.readers(processes=False).hosts
            return [(h.transfer.version, h.transfer.last_delta) for h in hosts if h.state == "reporting" and h.transfer]

        wait_for(lambda: reported() == [(11, True)] * 4, timeout=STUCK_S, what="every host's report of version 11")
        listed = [""]

        def every_host_listed() -> bool:  # the reports as they stand when `ls` reads them
            listed[0] = cli("ls", store.name).stdout
            return listed[0].count("delta") >= 4 and "LAST VERSION" in listed[0]

        wait_for(every_host_listed, timeout=STUCK_S, what="the hosts' costs in `shmsync ls`")
        hosts.stop()
