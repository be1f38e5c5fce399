"""A version's delta on the wire: which leaves changed, and from which version (no torch here).

A node whose relay below holds the version just before ``v`` sends it ``v``'s delta (``DELT``)
instead of the whole version (``VERS``): the same version header, then the base version, the
number of leaves and their indices into the layout::

    DELT payload = version header (VERSION, or the sealing's HEADER) | base (q) | count (I) | count x index (I)

and as pieces the changed leaves' bytes, one after the other in layout order, without the
layout's gaps. Every field comes from a peer: :func:`parse` checks them all against the layout
(indices in range, each once, in order; the byte count theirs exactly; the base the version this
host holds) before a byte of the pieces is received.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from shmsync.errors import ProtocolError

DELTA = struct.Struct(">qI")  # base version, number of leaves; then that many big-endian uint32 indices
INDEX = struct.Struct(">I")


@dataclass(frozen=True)
class WireDelta:
    """A delta as it travels: from version ``base``, the leaves ``leaves``, ``nbytes`` of their bytes."""

    base: int
    leaves: tuple[int, ...]
    nbytes: int

    def tail(self) -> bytes:
        """What follows the version header in a ``DELT`` frame."""
        return DELTA.pack(self.base, len(self.leaves)) + packed(self.leaves)


def packed(leaves: Sequence[int]) -> bytes:
    return struct.pack(f">{len(leaves)}I", *leaves)


def digest(leaves: Sequence[int]) -> bytes:
    """What a sealing binds of the leaves it carries (see :mod:`shmsync.relay.sealing`)."""
    return hashlib.sha256(packed(leaves)).digest()


def frame_bytes(head: int, leaves: int) -> tuple[int, int]:
    """The fewest and most bytes a ``DELT`` frame may carry, with a version header of ``head``
    bytes, for a layout of ``leaves`` leaves."""
    return head + DELTA.size, head + DELTA.size + INDEX.size * leaves


def parse(tail: bytes, sizes: Sequence[int], held: int, version: int, announced: int, peer: str) -> WireDelta:
    """The delta a ``DELT`` frame's ``tail`` names, checked against the layout's leaf ``sizes``,
    the version this host holds (``held``) and the payload bytes the header ``announced``.

    Raises:
        ProtocolError: naming what is off (a base that is not the version held, a leaf out of
            range or out of order, a count or a byte count that disagrees with the layout).

    Examples:
        >>> delta = WireDelta(base=4, leaves=(1, 3), nbytes=24)
        >>> parse(delta.tail(), [8, 16, 4, 8], held=4, version=5, announced=24, peer="parent")
        WireDelta(base=4, leaves=(1, 3), nbytes=24)
    """
    if len(tail) < DELTA.size:
        raise ProtocolError(f"{peer} sent a delta header of {len(tail)} bytes; at least {DELTA.size} were expected")
    base, count = DELTA.unpack_from(tail)
    if held < 0 or base != held:
        have = f"holds version {held}" if held >= 0 else "holds no version yet"
        raise ProtocolError(f"{peer} sent version {version} as a delta from version {base}, but this host {have}")
    if count > len(sizes) or len(tail) != DELTA.size + INDEX.size * count:
        raise ProtocolError(
            f"{peer} sent a delta of {count} leaves in {len(tail) - DELTA.size} bytes of indices; the layout has "
            f"{len(sizes)} leaves, {INDEX.size} bytes each"
        )
    leaves = struct.unpack_from(f">{count}I", tail, DELTA.size)
    last = -1
    for i in leaves:
        if not last < i < len(sizes):
            why = "out of range" if i >= len(sizes) else "not in increasing order"
            raise ProtocolError(
                f"{peer} sent a delta naming leaf {i} after leaf {last}: {why} (the layout has {len(sizes)} leaves)"
            )
        last = i
    nbytes = sum(sizes[i] for i in leaves)
    if announced != nbytes:
        raise ProtocolError(
            f"{peer} announced {announced} bytes for the delta of version {version}; its {count} leaves hold "
            f"{nbytes} bytes in the layout"
        )
    return WireDelta(base, leaves, nbytes)


__all__ = ["DELTA", "WireDelta", "digest", "frame_bytes", "parse"]
