"""A relay's versions coming in from its parent: each received straight into a free slot of this
host's store, each piece checked before it is there and forwarded at once to the relays below,
the version committed under the trainer's number once its last byte is in. With encrypted links
the pieces come sealed once for the whole tree (:mod:`shmsync.relay.sealing`): each is kept as it
came, for the relays below, and opened once into the slot.

A delta (``DELT``: the leaves changed since the version this host holds, :mod:`shmsync.relay.deltas`)
is received into a buffer of its own size, forwarded from there to the relays below that hold the
same version, and published once it is all in: its leaves from the buffer, the rest of what the
slot lacks from this host's newest version (:meth:`~shmsync.WeightStore.publish_delta`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from shmsync.core.protocol import Write
from shmsync.errors import ProtocolError, RelayError
from shmsync.relay import deltas, wire
from shmsync.relay.deltas import WireDelta
from shmsync.relay.messages import (
    BYE,
    CNCL,
    DATA,
    DELT,
    MAX_VERSION,
    MAX_VERSION_LEAP,
    PING,
    STOP,
    VERS,
    VERSION,
    Forwarding,
)
from shmsync.relay.raw_versions import create_from_bytes
from shmsync.relay.sealing import HEADER, TAG_BYTES, SealedVersion


@dataclass(frozen=True)
class Received:
    """What one version cost the link it came on: its frames' bytes, and whether it came as a delta."""

    version: int
    wire_bytes: int
    delta: bool
    seconds: float


def follow(relay: Any, link: wire.Link, max_versions: int | None) -> str:
    """Receive versions from ``link`` until the trainer closed its sender (``"stopped"``) or
    ``max_versions`` were published here (``"enough"``)."""
    sizes = [e.nbytes for e in relay.layout.entries]
    head = VERSION.size if link.keys is None else HEADER.size  # both begin with the version and its size
    allowed: dict[bytes, int | tuple[int, int]] = {VERS: (head, head), PING: 0, STOP: 0, BYE: 0}
    allowed[DELT] = deltas.frame_bytes(head, len(sizes))
    while max_versions is None or relay.received < max_versions:
        # The parent sends a keepalive while idle: silence for `timeout` means it is gone.
        kind, length = link.recv_frame(allowed, relay.timeout)
        if kind == PING:
            continue
        if kind == STOP:
            return "stopped"
        if kind == BYE:
            raise Left(f"{link.peer} left the tree")
        began, before = time.monotonic(), link.bytes_received - wire.FRAME.size  # its frame's head came
        header = link.recv_payload(relay.timeout)
        version, size, delta = _checked_header(relay, link.peer, header, kind == DELT, head, sizes)
        sealed = None
        if link.keys is not None:  # whole: kept for the relays below (if any may come)
            base, leaves = (delta.base, delta.leaves) if delta is not None else (-1, ())
            sealed = SealedVersion.receiving(
                relay.secret, header[:head], size, whole=relay.server is not None, base=base, leaves=leaves
            )
        if _receive(relay, link, version, sealed, delta):
            relay.received += 1
            took = link.bytes_received - before
            relay.note_received(Received(version, took, delta is not None, time.monotonic() - began))
    return "enough"


def _checked_header(
    relay: Any, peer: str, header: bytes, is_delta: bool, head: int, sizes: list[int]
) -> tuple[int, int, WireDelta | None]:
    """A version's header (``VERS``, or ``DELT`` for a delta) checked against the version this host
    holds and the layout, before a byte more comes: the version, its payload bytes, its delta."""
    version, size = VERSION.unpack_from(header)
    held = relay.store.version if relay.store is not None else -1
    if not (held < version <= MAX_VERSION) or (held >= 0 and version - held > MAX_VERSION_LEAP):
        raise ProtocolError(
            f"{peer} sent version {version}; this host holds {held} (versions only go up, by at most "
            f"{MAX_VERSION_LEAP} at a time, to at most {MAX_VERSION})"
        )
    if is_delta:
        return version, size, deltas.parse(header[head:], sizes, held, version, size, peer)
    if size != relay.layout.payload_bytes:
        raise ProtocolError(
            f"{peer} announced {size} bytes for version {version}; the layout holds {relay.layout.payload_bytes} bytes"
        )
    return version, size, None


def _receive(
    relay: Any, link: wire.Link, version: int, sealed: SealedVersion | None, delta: WireDelta | None = None
) -> bool:
    """Receive one version (or its delta) and commit it; False if the sender cancelled it."""
    shelf = relay.server.sealed if relay.server is not None and sealed is not None else None
    if shelf is not None:
        shelf.hold(sealed)
    complete = False
    try:
        if delta is None:
            complete = _receive_into_store(relay, link, version, sealed)
        else:
            complete = _receive_delta(relay, link, version, sealed, delta)
    finally:
        if shelf is None:
            if sealed is not None:
                sealed.release()
        else:
            if complete:
                shelf.keep(sealed)  # for relays that join, or fall behind, later
            shelf.let_go(sealed)
    return complete


def _receive_into_store(relay: Any, link: wire.Link, version: int, sealed: SealedVersion | None) -> bool:
    def fill(buffer: memoryview, write: Write) -> None:
        fwd = None
        if relay.server is not None and relay.store is not None:
            fwd = relay.server.begin(version, len(buffer), write, sealed)
        with _forwarding(relay, fwd):
            _fill(relay, link, buffer, fwd, sealed)

    try:
        if relay.store is None:
            relay.store = create_from_bytes(
                relay.description, fill, version=version, name=relay.name, num_slots=relay.num_slots
            )
            if relay.server is not None:
                relay.server.set_store(relay.store)
        else:
            relay.store.publish_bytes(fill, version=version)
    except Cancelled:
        return False
    return True


def _receive_delta(relay: Any, link: wire.Link, version: int, sealed: SealedVersion | None, delta: WireDelta) -> bool:
    """Receive a delta into a buffer of its size (at most the layout's: checked), forwarding it to
    the relays below as it arrives, then publish it."""
    payload = bytearray(delta.nbytes)
    fwd = None
    if relay.server is not None:
        fwd = relay.server.begin(version, delta.nbytes, None, sealed, delta, payload)
    try:
        with _forwarding(relay, fwd):
            with memoryview(payload) as view:
                _fill(relay, link, view, fwd, sealed)
            relay.store.publish_delta(payload, version=version, base=delta.base, leaves=delta.leaves)
    except Cancelled:
        return False
    return True


@contextmanager
def _forwarding(relay: Any, fwd: Forwarding | None) -> Iterator[None]:
    """End the forwarding of a version to the relays below (``fwd``; None: none) as its receipt
    ends: whole, or not on an error; on a cancel it is left as it stands."""
    try:
        yield
    except Cancelled:
        raise
    except BaseException:
        if fwd is not None:
            relay.server.end(fwd, complete=False)
        raise
    if fwd is not None:
        relay.server.end(fwd, complete=True)


def _fill(
    relay: Any, link: wire.Link, buffer: memoryview, fwd: Forwarding | None, sealed: SealedVersion | None
) -> None:
    """Receive a version's frames into ``buffer``; each piece is there (and forwarded) only
    once it passed its check."""
    n, got, piece = len(buffer), 0, 0
    while got < n:
        if sealed is None:
            size = (1, min(n - got, relay.bucket))
        else:  # exactly the next sealed piece
            size = (sealed.span(piece)[1] + TAG_BYTES,) * 2
        kind, length = link.recv_frame({DATA: size, CNCL: 0, STOP: 0, BYE: 0}, relay.timeout)
        if kind in (CNCL, STOP, BYE):
            if fwd is not None:
                relay.server.end(fwd, complete=False)
            if kind == CNCL:
                raise Cancelled()
            raise Left(f"{link.peer} stopped in the middle of a version")
        if sealed is None:
            link.recv_payload_into(buffer[got : got + length], relay.timeout)
            got += length
        else:
            link.recv_payload_into(sealed.sealed(piece), relay.timeout, sealed=True)
            sealed.open(piece, buffer)
            got, piece = got + sealed.span(piece)[1], piece + 1
        if fwd is not None:
            relay.server.advance(fwd, got)


class Cancelled(RelayError):
    """The parent cancelled the version being received (it will send a newer one)."""


class Left(RelayError):
    """The parent stopped feeding this relay (it is leaving the tree): attach elsewhere."""
