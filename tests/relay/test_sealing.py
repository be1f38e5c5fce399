"""Sealing a version once for the whole relay tree (shmsync.relay.sealing): what opens is exactly
what was sealed, in its place; anything else (another version, another sealing, another index, a
flipped bit, another secret) fails its check, and no later piece opens. No processes: the relay
tests play the same pieces against a real relay, whose host keeps its last whole version."""

from __future__ import annotations

import os
import threading

import pytest

from shmsync.errors import AuthenticationError, ProtocolError
from shmsync.relay import sealing
from shmsync.relay.sealing import HEADER, TAG_BYTES, SealedShelf, SealedVersion

SECRET = b"the sealing tests' relay secret, 32 bytes or more"
PIECE = sealing.MIN_PIECE_BYTES
PAYLOAD = bytes(range(256)) * 56  # 14,336 bytes: three whole pieces and a half


def sealed(version=3, payload=PAYLOAD, secret=SECRET, piece=PIECE):
    out = SealedVersion.sealing(secret, version, len(payload), piece)
    out.seal_upto(out.count - 1, memoryview(payload))
    return out


def receiver(header, nbytes=len(PAYLOAD), secret=SECRET, whole=False):
    return SealedVersion.receiving(secret, header, nbytes, whole=whole)


def deliver(got, frames, out):
    """Receive ``frames`` (sealed pieces, as the wire carries them) into ``got``, opening each into ``out``."""
    for i, frame in enumerate(frames):
        got.sealed(i)[:] = frame
        got.open(i, out)


def frames_of(version):
    return [bytes(version.sealed(i)) for i in range(version.count)]


@pytest.mark.parametrize("whole", [False, True])
def test_what_opens_is_what_was_sealed(whole):
    sent = sealed()
    assert sent.count == 4 and [len(f) for f in frames_of(sent)] == [PIECE + TAG_BYTES] * 3 + [2048 + TAG_BYTES]
    out = memoryview(bytearray(len(PAYLOAD)))
    got = receiver(sent.header(), whole=whole)
    deliver(got, frames_of(sent), out)
    assert bytes(out) == PAYLOAD and got.ready == got.count
    assert all(PAYLOAD[:64] not in f for f in frames_of(sent)), "a piece went out readable"


def _attempt(header, frames, secret=SECRET):
    """Open ``frames`` under ``header``: the error, the pieces that opened, and the payload as
    written (a piece that fails may leave bytes in its place: the version is never published)."""
    out = memoryview(bytearray(len(PAYLOAD)))
    got = receiver(header, secret=secret)
    with pytest.raises(AuthenticationError) as error:
        deliver(got, frames, out)
    return str(error.value), got.ready, bytes(out)


def test_a_piece_of_another_version_fails():
    v2, v3 = sealed(version=2), sealed(version=3)
    error, opened, _ = _attempt(v3.header(), frames_of(v2))
    assert "piece 0 of version 3 failed its check" in error and opened == 0


def test_a_piece_of_another_sealing_of_the_same_version_fails():
    first, second = sealed(), sealed()
    assert first.salt != second.salt, "two sealings drew one salt"
    frames = frames_of(first)
    frames[2] = frames_of(second)[2]
    error, opened, out = _attempt(first.header(), frames)
    assert "piece 2 of version 3" in error and opened == 2 and out[: 2 * PIECE] == PAYLOAD[: 2 * PIECE]


def test_pieces_out_of_place_fail():
    sent = sealed(payload=bytes(4 * PIECE))  # four pieces alike: only the index tells them apart
    frames = frames_of(sent)
    frames[0], frames[1] = frames[1], frames[0]
    out = memoryview(bytearray(4 * PIECE))
    got = receiver(sent.header(), nbytes=4 * PIECE)
    with pytest.raises(AuthenticationError, match="piece 0 of version 3"):
        deliver(got, frames, out)


@pytest.mark.parametrize("where", [0, PIECE // 2, PIECE + TAG_BYTES - 1])
def test_a_flipped_bit_fails(where):
    sent = sealed()
    frames = frames_of(sent)
    frames[1] = frames[1][:where] + bytes([frames[1][where] ^ 1]) + frames[1][where + 1 :]
    error, opened, _ = _attempt(sent.header(), frames)
    assert "piece 1 of version 3" in error and opened == 1


def test_another_secret_opens_nothing():
    sent = sealed()
    error, opened, _ = _attempt(sent.header(), frames_of(sent), secret=b"another relay secret of 32 bytes or more")
    assert "piece 0 of version 3" in error and opened == 0


def test_a_header_with_another_size_or_piece_size_fails_the_first_piece():
    sent = sealed()
    version, nbytes, piece, salt = HEADER.unpack(sent.header())
    other_piece = HEADER.pack(version, nbytes, piece + 1, salt)
    with pytest.raises(AuthenticationError):
        got = SealedVersion.receiving(SECRET, other_piece, nbytes, whole=True)
        got.sealed(0)[: PIECE + TAG_BYTES] = frames_of(sent)[0]
        got.open(0, memoryview(bytearray(nbytes)))


def test_pieces_open_only_in_order():
    sent = sealed()
    got = receiver(sent.header(), whole=True)
    got.sealed(1)[:] = frames_of(sent)[1]
    with pytest.raises(ProtocolError, match="piece 1 of version 3 opened where piece 0 is next"):
        got.open(1, memoryview(bytearray(len(PAYLOAD))))


@pytest.mark.parametrize(
    "header, match",
    [
        (b"\0" * (HEADER.size - 1), "header of 55 bytes; 56 bytes were expected"),
        (HEADER.pack(1, len(PAYLOAD) + 1, PIECE, bytes(32)), "announced 14337 bytes for version 1; the layout holds"),
        (HEADER.pack(1, len(PAYLOAD), 0, bytes(32)), "piece size is 0 bytes"),
        (HEADER.pack(1, len(PAYLOAD), 1, bytes(32)), "piece size is 1 bytes; 4096 to"),  # 17x the payload
        (HEADER.pack(1, len(PAYLOAD), (1 << 30) + 1, bytes(32)), "piece size is 1073741825 bytes"),
        (HEADER.pack(1, len(PAYLOAD), (1 << 64) - 1, bytes(32)), "piece size is 18446744073709551615 bytes"),
    ],
)
def test_a_header_is_checked_before_anything_is_allocated(header, match):
    with pytest.raises(ProtocolError, match=match):
        receiver(header, whole=True)


def test_threads_sealing_at_once_seal_every_piece_once_in_order():
    payload = os.urandom(64 * PIECE)
    version = SealedVersion.sealing(SECRET, 9, len(payload), PIECE)
    view = memoryview(payload)
    threads = [threading.Thread(target=version.seal_upto, args=(k, view)) for k in (63, 10, 40, 63)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert version.ready == 64
    out = memoryview(bytearray(len(payload)))
    got = SealedVersion.receiving(SECRET, version.header(), len(payload), whole=False)
    for i in range(64):
        got.sealed(i)[:] = version.sealed(i)
        got.open(i, out)
    assert bytes(out) == payload


def test_a_released_buffer_goes_to_the_next_version_of_its_size():
    first = sealed(version=1)
    buffer = first._buffer
    first.release()
    assert first.released and sealed(version=2)._buffer is buffer
    others = [SealedVersion.sealing(SECRET, v, len(PAYLOAD), PIECE) for v in range(3, 6)]
    for other in others:
        other.release()
    assert len(sealing._spare[len(buffer)]) <= sealing.SPARE


def test_the_shelf_seals_each_version_once_for_every_link_and_keeps_only_the_newest():
    shelf = SealedShelf(SECRET, PIECE)
    a, b = shelf.take(1, len(PAYLOAD)), shelf.take(1, len(PAYLOAD))
    assert a is b and a.users == 2
    a.seal_upto(a.count - 1, memoryview(PAYLOAD))
    newer = shelf.take(2, len(PAYLOAD))
    shelf.let_go(a)
    assert not a.released, "a version was let go while a link still sends it"
    shelf.let_go(b)
    assert a.released and not newer.released
    shelf.let_go(newer)
    assert not newer.released and shelf.take(2, len(PAYLOAD)) is newer, "the newest was not kept"
    shelf.let_go(newer)
    shelf.close()
    assert newer.released


def test_a_received_version_is_kept_only_whole_and_held_only_until_released():
    shelf = SealedShelf(SECRET, PIECE)
    sent = sealed(version=4)
    got = receiver(sent.header(), whole=True)
    assert shelf.hold(got) is got
    deliver(got, frames_of(sent), memoryview(bytearray(len(PAYLOAD))))
    shelf.keep(got)
    shelf.let_go(got)
    assert shelf.take(4, len(PAYLOAD)) is got and got.ready == got.count
    cancelled = receiver(sealed(version=5).header(), whole=True)
    shelf.hold(cancelled)
    shelf.let_go(cancelled)
    assert cancelled.released and shelf.hold(cancelled) is None


def test_links_that_hold_two_versions_make_a_third_wait_for_its_sealing():
    """Links that trickle bytes cannot make a node hold a sealed copy each: a third version is
    sealed only once one of the two in use is let go."""
    shelf = SealedShelf(SECRET, PIECE)
    one, two = shelf.take(1, len(PAYLOAD)), shelf.take(2, len(PAYLOAD))
    assert shelf.take(3, len(PAYLOAD)) is None
    assert shelf.take(2, len(PAYLOAD)) is two, "the newest, sealed already, was refused"
    shelf.let_go(one)
    three = shelf.take(3, len(PAYLOAD))
    assert three is not None and one.released and not two.released
