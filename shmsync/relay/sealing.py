"""Each version sealed once, where it enters the tree, and opened once on each host (no torch here).

With encrypted links, the node that first sends a version (the trainer) seals it piece by piece
under a key of that sealing alone::

    key   = HKDF-SHA256(secret, salt = 32 random bytes,
                        info = INFO | version | size | piece size | base | SHA-256(leaves))
    piece = AES-256-GCM(key, nonce = i (12 bytes), piece i of the payload, aad = "SEAL" | i)

where a whole version has base -1 and no leaves, and a delta (:mod:`shmsync.relay.deltas`: the
leaves changed since ``base``, the version before it) its base and the indices of its leaves. A
node seals a version's delta once, for every relay holding the version before it, and its whole
form only when a relay needs it (one that joins, or holds anything else).

and every relay forwards the sealed pieces to the relays below it as they are, opening each once,
straight into a free slot of its host's store. The salt travels in the version's header (``VERS``),
a control frame of the link, so it is sealed and counted by the link's own keys: only a holder of
the secret reads it, and a header from another version or link fails that link's check.

Why this is safe:

- **Nonces never repeat under one key.** Each sealing draws a fresh 32-byte salt, so its key is
  its own (two sealings share a key with probability 2**-256, whatever the trainers, restarts or
  versions), and within one sealing piece ``i`` is sealed once, under nonce ``i``.
- **A piece cannot move.** The key binds the version, the payload size, the piece size, and for
  a delta its base version and its leaves; the nonce and the associated data bind the index.
  A piece from another version, another sealing of the same version, or another delta (a
  delta's pieces never open as the whole version's) fails (another key), a piece out of place
  fails (another index), a piece cut short or altered fails (the tag), and a piece left out
  shifts every later one, which then fails. The relay publishes a version only once every piece passed.
- **What changed for whom** (docs/security.md): a stranger still proves nothing, and an
  on-path attacker still reads and alters nothing. Holders of the secret could always read every
  link and write any version; relays no longer re-seal what they forward, which gave them nothing.

``cryptography`` holds the GIL while it seals or opens (10 GB/s here: 0.1 ms a 1 MiB piece), so
a node seals a piece at a time, and other threads run between pieces.
"""

from __future__ import annotations

import secrets
import struct
import threading
from collections.abc import Sequence

from shmsync.errors import ProtocolError
from shmsync.relay.deltas import digest
from shmsync.relay.wire import aead_class, derive_key, open_checked

INFO = b"shmsync relay 6 seal"
SALT_BYTES = 32
TAG_BYTES = 16
MIN_PIECE_BYTES = 4096  # tags and frames add at most 0.4 % (a version's last piece may be shorter)
MAX_PIECE_BYTES = 1 << 30
# The header a sealed version travels under (VERS): version, payload bytes, piece bytes, salt.
HEADER = struct.Struct(">qQQ32s")
SPARE = 1  # sealed buffers kept per size for the next version (their pages are already mapped)
MAX_SENDING = 2  # sealed versions a node's links send (or it receives) at once

_spare: dict[int, list[bytearray]] = {}
_spare_lock = threading.Lock()


def _buffer(size: int) -> bytearray:
    """A buffer of ``size`` bytes, one a former version left if there is one: a fresh one costs
    a page fault per 4 KiB the first time it is written (more than the cipher itself)."""
    with _spare_lock:
        kept = _spare.get(size)
        if kept:
            return kept.pop()
    return bytearray(size)


def _give_back(buffer: bytearray) -> None:
    with _spare_lock:
        kept = _spare.setdefault(len(buffer), [])
        if len(kept) < SPARE:
            kept.append(buffer)


def _key(secret: bytes, salt: bytes, version: int, nbytes: int, piece: int, base: int = -1, leaves: Sequence[int] = ()):
    info = INFO + struct.pack(">qQQq", version, nbytes, piece, base) + digest(leaves)
    return aead_class()(derive_key(secret, salt, info))


class SealedVersion:
    """One version's sealed pieces, the whole version or its delta: sealed here (:meth:`sealing`)
    or received from a parent (:meth:`receiving`), held for the links that send them on.

    Args:
        secret: the relay secret.
        version, nbytes, piece, salt: the version's header (:data:`HEADER`).
        whole: keep every sealed piece (to send them on); False keeps one piece's room, which
            each piece received reuses (a leaf relay).
        base, leaves: for a delta, the version it is from and its leaves (-1 and none: the whole
            version).

    Example:
        >>> secret = b"a relay secret of at least 32 bytes!"
        >>> payload = memoryview(bytearray(b"weights" * 2000))  # 14,000 bytes
        >>> sent = SealedVersion.sealing(secret, version=3, nbytes=len(payload), piece=4096)
        >>> sent.seal_upto(sent.count - 1, payload)
        >>> got = SealedVersion.receiving(secret, sent.header(), nbytes=len(payload), whole=False)
        >>> out = memoryview(bytearray(len(payload)))
        >>> for i in range(got.count):
        ...     got.sealed(i)[:] = sent.sealed(i)  # what the wire carries
        ...     got.open(i, out)
        >>> bytes(out) == bytes(payload)
        True
    """

    def __init__(
        self,
        secret: bytes,
        version: int,
        nbytes: int,
        piece: int,
        salt: bytes,
        *,
        whole: bool = True,
        base: int = -1,
        leaves: Sequence[int] = (),
    ) -> None:
        fewest = min(MIN_PIECE_BYTES, max(nbytes, 1))
        if not fewest <= piece <= MAX_PIECE_BYTES:
            raise ProtocolError(
                f"a sealed version's piece size is {piece} bytes; {fewest} to {MAX_PIECE_BYTES} bytes were expected"
            )
        self.version, self.nbytes, self.piece, self.salt = version, nbytes, piece, salt
        self.base, self.leaves = base, tuple(leaves)
        self.count = max(1, -(-nbytes // piece))
        self._aead = _key(secret, salt, version, nbytes, piece, base, self.leaves)
        self._stride = piece + TAG_BYTES if whole else 0
        self._buffer = _buffer(self.count * self._stride if whole else min(piece, nbytes) + TAG_BYTES)
        self.ready = 0  # pieces sealed, or received and opened (in order)
        self.users = 0  # links sending from it, and the link receiving it (SealedShelf)
        self.released = False
        self._lock = threading.Lock()

    @classmethod
    def sealing(
        cls, secret: bytes, version: int, nbytes: int, piece: int, base: int = -1, leaves: Sequence[int] = ()
    ) -> SealedVersion:
        """A new sealing of ``version`` (``nbytes`` in pieces of ``piece``; a delta from ``base``
        of ``leaves``), under a fresh salt."""
        return cls(secret, version, nbytes, piece, secrets.token_bytes(SALT_BYTES), base=base, leaves=leaves)

    @classmethod
    def receiving(
        cls, secret: bytes, header: bytes, nbytes: int, whole: bool, base: int = -1, leaves: Sequence[int] = ()
    ) -> SealedVersion:
        """The sealed version (or delta, from ``base`` of ``leaves``) a parent announced in
        ``header``, checked (size, piece) before a byte is allocated for it.

        Raises:
            ProtocolError: the header is not :data:`HEADER`, or announces another size than
                ``nbytes`` (the layout's, or the delta's leaves') or a piece size out of range.
        """
        if len(header) != HEADER.size:
            raise ProtocolError(f"a sealed version's header of {len(header)} bytes; {HEADER.size} bytes were expected")
        version, size, piece, salt = HEADER.unpack(header)
        if size != nbytes:
            raise ProtocolError(f"announced {size} bytes for version {version}; the layout holds {nbytes} bytes")
        return cls(secret, version, nbytes, piece, salt, whole=whole, base=base, leaves=leaves)

    def header(self) -> bytes:
        return HEADER.pack(self.version, self.nbytes, self.piece, self.salt)

    def span(self, i: int) -> tuple[int, int]:
        """Where piece ``i`` lies in the payload: (offset, length)."""
        offset = i * self.piece
        return offset, min(self.piece, self.nbytes - offset)

    def sealed(self, i: int) -> memoryview:
        """Piece ``i`` as sealed (its length and the tag): what goes on the wire."""
        start = i * self._stride
        return memoryview(self._buffer)[start : start + self.span(i)[1] + TAG_BYTES]

    def seal_upto(self, i: int, payload: memoryview) -> None:
        """Seal the pieces of ``payload`` (this version's bytes) up to piece ``i``, each once, in
        order, whichever link asks first (the others wait for it)."""
        with self._lock:
            while self.ready <= i:
                offset, n = self.span(self.ready)
                self._aead.encrypt_into(_nonce(self.ready), payload[offset : offset + n], _aad(self.ready),
                                        self.sealed(self.ready))  # fmt: skip
                self.ready += 1

    def open(self, i: int, payload: memoryview) -> None:
        """Check piece ``i`` (in :meth:`sealed`) and write it into its place in ``payload``.
        Pieces open in order. A piece that fails may leave bytes in its place (the cipher writes
        as it checks): the caller then gives up the version, which is never published.

        Raises:
            AuthenticationError: it is not piece ``i`` of this sealing, whole and unaltered.
        """
        if i != self.ready:
            raise ProtocolError(f"piece {i} of version {self.version} opened where piece {self.ready} is next")
        offset, n = self.span(i)
        why = (
            f"piece {i} of version {self.version} failed its check: it is not that piece of that sealing "
            "(replayed from another version, reordered, mixed in or altered on the way)"
        )
        open_checked(self._aead, _nonce(i), self.sealed(i), _aad(i), payload[offset : offset + n], why)
        self.ready = i + 1

    def release(self) -> None:
        """Give the buffer to the next version of the same size (nothing may use it after)."""
        buffer, self._buffer, self.released = self._buffer, bytearray(), True
        if len(buffer):
            _give_back(buffer)


def _nonce(i: int) -> bytes:
    return i.to_bytes(12, "big")


def _aad(i: int) -> bytes:
    return b"SEAL" + i.to_bytes(8, "big")


class SealedShelf:
    """The sealed versions one node's links send from: each version's delta and its whole form
    each sealed (or kept as received) once for all of them. The newest of each stays for links
    that come later; an older one goes as its last link lets it go. At most :data:`MAX_SENDING`
    versions are in use at once: a link that would seal another waits (as for a slot to lease),
    so links that trickle bytes cannot make a node hold a sealed copy each.

    Args:
        secret: the relay secret.
        piece: the piece size this node seals in (at least :data:`MIN_PIECE_BYTES`).
    """

    def __init__(self, secret: bytes, piece: int) -> None:
        self.secret, self.piece = secret, max(piece, MIN_PIECE_BYTES)
        self._newest: dict[bool, SealedVersion] = {}  # by whether it is a delta
        self._sending = 0  # versions with users
        self._lock = threading.Lock()

    def take(self, version: int, nbytes: int, base: int = -1, leaves: Sequence[int] = ()) -> SealedVersion | None:
        """The sealed ``version`` to send, whole or its delta from ``base`` (a new sealing if this
        node holds none of it), to hand back with :meth:`let_go`; None while :data:`MAX_SENDING`
        other versions are in use."""
        with self._lock:
            newest = self._newest.get(base >= 0)
            held = newest
            if held is None or (held.version, held.nbytes, held.base, held.leaves) != (
                version,
                nbytes,
                base,
                tuple(leaves),
            ):
                if self._sending >= MAX_SENDING:
                    return None
                held = SealedVersion.sealing(self.secret, version, nbytes, self.piece, base, leaves)
                if newest is None or version >= newest.version:
                    self._replace(held)
            self._use(held)
            return held

    def hold(self, sealed: SealedVersion) -> SealedVersion | None:
        """Use ``sealed`` (a version being received) until :meth:`let_go`; None if it is gone
        already (cancelled, and let go by every link)."""
        with self._lock:
            if sealed.released:
                return None
            self._use(sealed)
            return sealed

    def keep(self, sealed: SealedVersion) -> None:
        """Keep a version (or delta) received in full (every piece opened) for links that send it later."""
        with self._lock:
            newest = self._newest.get(sealed.base >= 0)
            if newest is None or sealed.version > newest.version:
                self._replace(sealed)

    def let_go(self, sealed: SealedVersion) -> None:
        with self._lock:
            sealed.users -= 1
            if sealed.users == 0:
                self._sending -= 1
                if sealed is not self._newest.get(sealed.base >= 0):
                    sealed.release()

    def _use(self, sealed: SealedVersion) -> None:
        sealed.users += 1
        if sealed.users == 1:
            self._sending += 1

    def _replace(self, sealed: SealedVersion) -> None:
        kind = sealed.base >= 0
        old, self._newest[kind] = self._newest.get(kind), sealed
        if old is not None and old.users == 0:
            old.release()

    def close(self) -> None:
        with self._lock:
            for sealed in self._newest.values():
                if sealed.users == 0:
                    sealed.release()
            self._newest = {}


__all__ = ["HEADER", "SealedShelf", "SealedVersion"]
