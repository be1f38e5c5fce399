"""A relay's versions coming in from its parent: each received straight into a free slot of this
host's store, each piece checked before it is there and forwarded at once to the relays below,
the version committed under the trainer's number once its last byte is in. With encrypted links
the pieces come sealed once for the whole tree (:mod:`shmsync.relay.sealing`): each is kept as it
came, for the relays below, and opened once into the slot."""

from __future__ import annotations

from typing import Any

from shmsync.core.protocol import Write
from shmsync.errors import ProtocolError, RelayError
from shmsync.relay import wire
from shmsync.relay.messages import (
    BYE,
    CNCL,
    DATA,
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


def follow(relay: Any, link: wire.Link, max_versions: int | None) -> str:
    """Receive versions from ``link`` until the trainer closed its sender (``"stopped"``) or
    ``max_versions`` were published here (``"enough"``)."""
    nbytes = relay.layout.payload_bytes
    head = VERSION.size if link.keys is None else HEADER.size  # both begin with the version and its size
    while max_versions is None or relay.received < max_versions:
        # The parent sends a keepalive while idle: silence for `timeout` means it is gone.
        kind, _ = link.recv_frame({VERS: (head, head), PING: 0, STOP: 0, BYE: 0}, relay.timeout)
        if kind == PING:
            continue
        if kind == STOP:
            return "stopped"
        if kind == BYE:
            raise Left(f"{link.peer} left the tree")
        header = link.recv_payload(relay.timeout)
        version, size = VERSION.unpack_from(header)
        held = relay.store.version if relay.store is not None else -1
        if not (held < version <= MAX_VERSION) or (held >= 0 and version - held > MAX_VERSION_LEAP):
            raise ProtocolError(
                f"{link.peer} sent version {version}; this host holds {held} (versions only go up, by at most "
                f"{MAX_VERSION_LEAP} at a time, to at most {MAX_VERSION})"
            )
        if size != nbytes:
            raise ProtocolError(
                f"{link.peer} announced {size} bytes for version {version}; the layout holds {nbytes} bytes"
            )
        sealed = None
        if link.keys is not None:  # whole: kept for the relays below (if any may come)
            sealed = SealedVersion.receiving(relay.secret, header, nbytes, whole=relay.server is not None)
        if _receive(relay, link, version, sealed):
            relay.received += 1
    return "enough"


def _receive(relay: Any, link: wire.Link, version: int, sealed: SealedVersion | None) -> bool:
    """Receive one version into a free slot and commit it; False if the sender cancelled it."""
    shelf = relay.server.sealed if relay.server is not None and sealed is not None else None
    if shelf is not None:
        shelf.hold(sealed)
    complete = False
    try:
        complete = _receive_into_store(relay, link, version, sealed)
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
        try:
            _fill(relay, link, buffer, fwd, sealed)
        except Cancelled:
            raise
        except BaseException:
            if fwd is not None:
                relay.server.end(fwd, complete=False)
            raise
        if fwd is not None:
            relay.server.end(fwd, complete=True)

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
