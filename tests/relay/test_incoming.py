"""What a relay takes from its parent (shmsync/relay/incoming.py): versions checked before a
byte is published. A parent that breaks the protocol, cuts a version short or sends pieces of
another version leaves the host on its last whole version."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from shmsync.relay import wire
from tests.relay.fakes import FakeTrainer, admit, chain, description, relay_against, sealed, send_sealed, send_version

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(120)]


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
    layout, nbytes = description()

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
            assert admit(link, layout) == {"version": -1}
            if hostile == "short version":
                send_version(link, 1, 100, [b"x" * 100])
            elif hostile == "long piece":
                send_version(link, 1, nbytes, [b"x" * (nbytes + 1)])
            elif hostile == "empty piece":
                send_version(link, 1, nbytes, [b""])
            elif hostile == "pieces of 1 byte":
                send_version(link, 1, nbytes, [b"x"])
            elif hostile == "a version inside a version":
                send_version(link, 1, nbytes, [b"x" * 4096])
                send_version(link, 2, nbytes, [])
            elif hostile == "negative version":
                send_version(link, -1, nbytes, [])
            elif hostile == "a version header of 8 bytes":
                link.send(b"VERS", b"\0" * 8)
            elif hostile == "the largest version":
                send_version(link, (1 << 63) - 1, nbytes, [b"x" * nbytes])
        link.sock.recv(1)  # until the relay hangs up

    error, snapshot = relay_against(FakeTrainer(script), one_host)
    assert error is not None and re.search(match, chain(error)), chain(error)
    assert snapshot is None
    assert os.listdir(one_host) == [], "something was published on the relay's host"


def test_a_version_cut_short_or_cancelled_leaves_the_host_on_its_last_whole_version(one_host):
    layout, nbytes = description()

    def script(link, attempt):
        have = admit(link, layout)
        if attempt == 1:
            assert have == {"version": -1}
            send_version(link, 3, nbytes, [b"\x03" * nbytes])  # a whole version: published
            send_version(link, 4, nbytes, [b"\x04" * 4096])
            link.send(b"CNCL")  # cancelled: never published
            send_version(link, 5, nbytes, [b"\x05" * 4096])  # then the trainer vanishes mid-version
        else:
            assert have == {"version": 3}, "the relay came back holding another version"
            link.send(b"STOP")

    error, snap = relay_against(FakeTrainer(script), one_host)
    assert error is None, chain(error)
    assert snap.version == 3 and all(bool((t.view(torch.uint8) == 3).all()) for t in snap.weights.values())


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
    layout, nbytes = description()
    size = 256 << 10  # five pieces

    def script(link, attempt):
        assert admit(link, layout) == {"version": -1}
        salt1, salt2 = os.urandom(32), os.urandom(32)
        one = sealed(1, b"\x01" * nbytes, size, salt1)
        send_sealed(link, 1, nbytes, size, salt1, one)
        two = sealed(2, b"\x02" * nbytes, size, salt2)
        if attack.startswith("an old version's"):
            frames = one
        elif attack == "pieces of two versions mixed":
            frames = two[:2] + one[2:]
        elif attack == "two pieces swapped":
            frames = [two[1], two[0], *two[2:]]
        elif attack.startswith("a piece of another sealing"):
            frames = [two[0], sealed(2, b"\x02" * nbytes, size, os.urandom(32))[1], *two[2:]]
        else:
            frames = list(two)
            frames[3] = frames[3][:100] + bytes([frames[3][100] ^ 0x40]) + frames[3][101:]
        send_sealed(link, 2, nbytes, size, salt2, frames)
        link.sock.recv(1)  # until the relay hangs up

    error, snap = relay_against(FakeTrainer(script), one_host)
    assert type(error).__name__ == "AuthenticationError", chain(error)
    assert f"piece {bad} of version 2 failed its check" in str(error), str(error)
    assert snap.version == 1 and all(bool((t.view(torch.uint8) == 1).all()) for t in snap.weights.values())


def test_a_trainer_without_the_secret_is_refused_at_once(one_host):
    fake = FakeTrainer(lambda link, attempt: None, secret="a trainer with another secret")
    error, _ = relay_against(fake, one_host, timeout=30)
    assert type(error).__name__ == "AuthenticationError", chain(error)
    assert fake.attempts == 1, "the relay tried again"  # at once: one attempt, none until its timeout
    assert os.listdir(one_host) == []
