"""The relay's messages, limits and small shared pieces (no torch here).

Relay -> server: JOIN, then HAVE or MISM; or PROB (a server checking this one's address: it
answers NODE); then, about once a second, RPRT (its readers' table, :mod:`shmsync.relay.reports`).
Server -> relay: REDI (go there instead), or LYOT and CONF; then per version VERS (the whole
version) or DELT (its delta, to a relay holding the version before it: :mod:`shmsync.relay.deltas`),
DATA..., CNCL (that version will not complete), PING while idle, and at the end STOP (the trainer
closed: end) or BYE (this server leaves: re-attach through the trainer).
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from shmsync.core.protocol import Write
from shmsync.errors import ProtocolError
from shmsync.relay import wire
from shmsync.relay.deltas import WireDelta
from shmsync.relay.sealing import SealedVersion
from shmsync.store.layout import key_str

log = logging.getLogger("shmsync.relay")

# Message kinds (see wire for the framing). Relay -> server: JOIN, then HAVE or MISM; or PROB
# (a server checking this one's address: it answers NODE). Server -> relay: REDI (go there
# instead), or LYOT and CONF; then per version VERS (or DELT: its delta), DATA..., CNCL (that
# version will not complete), PING while idle, and at the end STOP (the trainer closed: end) or
# BYE (this server leaves: re-attach through the trainer).
JOIN, HAVE, MISM, PROB, NODE = b"JOIN", b"HAVE", b"MISM", b"PROB", b"NODE"
REDI, LYOT, CONF = b"REDI", b"LYOT", b"CONF"
VERS, DELT, DATA, CNCL, PING, STOP, BYE = b"VERS", b"DELT", b"DATA", b"CNCL", b"PING", b"STOP", b"BYE_"
VERSION = struct.Struct(">qQ")  # version, payload bytes

FANOUT = 2  # below CHAIN_FROM_PIECES pieces
CHAIN_FROM_PIECES = 8
BUCKET_BYTES = 1 << 20
MAX_BUCKET_BYTES = 1 << 30
MAX_FANOUT = 64
MAX_PENDING = 4096  # handshakes under way at once (at most a quarter of the descriptors); beyond, one is cut
MAX_JOINING = 32  # peers that proved the secret and are joining, at once
SILENT_CUTOFF = 1.0  # seconds a new connection may send nothing
STALL_SECONDS = 1.0  # a relay that takes no bytes this long stalls: its link lets its slot go
MAX_LINKS = 256  # relays one server feeds, overflow included
MAX_DROPPED = 256  # relays remembered in `dropped`
MAX_HOPS = 16  # redirects followed before giving up
MAX_DEPTH = 256
MAX_VERSION = 1 << 62  # versions a peer may send (a store holds int64 versions)
MAX_VERSION_LEAP = 1 << 32  # how far above the host's version a relay's next version may be
CLOSE_WITHIN = 2.0  # close() returns within this many seconds, whatever the peers do


@dataclass
class Forwarding:
    """A version a relay is receiving: its children send its bytes as they arrive. A whole
    version arrives straight into a slot (``write``); a delta into ``payload``, which the
    children holding its base are sent from."""

    version: int
    nbytes: int
    write: Write | None
    sealed: SealedVersion | None = None  # its pieces as sealed where it entered the tree
    received: int = 0
    state: str = "receiving"  # then "complete" or "cancelled"
    delta: WireDelta | None = None
    payload: bytearray | None = None  # a delta's bytes, as they arrive


@dataclass
class Child:
    id: int
    node: str  # the relay's own random id (for cycle checks and its address's check)
    link: wire.Link
    serve: tuple[str, int] | None
    sent: int
    verified: bool = False  # a relay at `serve` proved the secret and this node id
    verifying: bool = True  # that check is under way
    in_version: bool = False  # a VERS went out, the version's end (its last DATA, or CNCL) not yet
    completes: int = -1  # the version a frame kept on the link ends (its last DATA), once flushed
    stalled_since: float | None = None  # when the relay last took no bytes for STALL_SECONDS
    thread: threading.Thread | None = field(default=None, repr=False)


class Throttled:
    """Logs a kind of message at most ``burst`` times per ``period`` seconds, then how many more."""

    def __init__(self, burst: int = 5, period: float = 10.0) -> None:
        self.burst, self.period = burst, period
        self.start, self.count, self.lock = 0.0, 0, threading.Lock()

    def warning(self, message: str) -> None:
        now = time.monotonic()
        with self.lock:
            if now - self.start > self.period:
                if self.count > self.burst:
                    log.warning("... and %d more like it in %.0f s", self.count - self.burst, self.period)
                self.start, self.count = now, 0
            self.count += 1
            if self.count > self.burst:
                return
        log.warning("%s", message)


def choose_fanout(payload_bytes: int, bucket_bytes: int) -> int:
    """The tree's shape for versions of ``payload_bytes`` sent in pieces of ``bucket_bytes``: a
    pipelined chain (1) once a version spans :data:`CHAIN_FROM_PIECES` pieces, else :data:`FANOUT`.

    In a chain each link carries a version once, and each relay forwards every piece as soon as it
    has it, so the last of H hosts has the version about (pieces + H - 1) piece-times after the
    trainer began, where a tree of fan-out 2 sends each piece twice from every node, at half the
    rate. With few pieces a piece-time is most of a version, and a tree's fewer hops win
    (``benchmarks/hosts_bench.py --fan-out`` measures both).

    Example:
        >>> choose_fanout(16 << 20, 1 << 20), choose_fanout(1 << 20, 1 << 20)
        (1, 2)
    """
    return 1 if payload_bytes >= CHAIN_FROM_PIECES * bucket_bytes else FANOUT


def check_join(doc: Any, peer: str) -> tuple[str, tuple[str, int] | None, bool]:
    """A JOIN's node id, serving address (None: a leaf) and whether it asks to be taken on here
    whatever the fan-out (``direct``, after being pointed round a circle), checked."""
    if not isinstance(doc, dict) or not {"node", "serve"} <= set(doc) <= {"node", "serve", "direct"}:
        raise ProtocolError(f"{peer} joined with {str(doc)[:100]}, not {{'node': ..., 'serve': ...}}")
    direct = doc.get("direct", False)
    if not isinstance(direct, bool):
        raise ProtocolError(f"{peer} joined with direct={str(direct)[:40]}, not true or false")
    node = doc["node"]
    if not (isinstance(node, str) and len(node) == 16 and all(c in "0123456789abcdef" for c in node)):
        raise ProtocolError(f"{peer} joined with node id {str(node)[:40]!r}, not 16 hex digits")
    serve = None if doc["serve"] is None else wire.address(doc["serve"], f"{peer}'s serving address")
    return node, serve, direct


def check_have(have: Any, newest: int, root: bool, peer: str) -> None:
    """The version a joining relay says its host holds, checked: none (-1) up to ``newest``, the
    newest the node it joins holds or is receiving (a relay's node may be behind the trainer:
    then up to a bound above it). Raises ProtocolError naming what is off."""
    if not (isinstance(have, int) and not isinstance(have, bool) and -1 <= have <= MAX_VERSION):
        raise ProtocolError(f"{peer} answered the layout with {str(have)[:100]}, not a version")
    most = newest if root else newest + MAX_VERSION_LEAP
    if have > most:
        raise ProtocolError(f"{peer} claims version {have}, but the newest here is {newest}")


def describe_difference(ours: bytes, theirs: bytes) -> str:
    """The first key, shape or dtype in which two store layouts differ, in words."""
    a, b = (json.loads(x) for x in (ours, theirs))
    rows_a = {key_str(tuple(r[0])): r for r in a["entries"]}
    rows_b = {key_str(tuple(r[0])): r for r in b["entries"]}
    missing, extra = sorted(set(rows_b) - set(rows_a)), sorted(set(rows_a) - set(rows_b))
    if missing or extra:
        return f"keys the trainer has and this store lacks {missing[:5]}, keys only here {extra[:5]}"
    for key in sorted(rows_a):
        (_, shape_a, dtype_a, *_), (_, shape_b, dtype_b, *_) = rows_a[key], rows_b[key]
        if shape_a != shape_b:
            return f"{key!r} has shape {tuple(shape_a)} here, {tuple(shape_b)} on the trainer"
        if dtype_a != dtype_b:
            return f"{key!r} has dtype {dtype_a} here, {dtype_b} on the trainer"
    return "the destinations or the byte layout differ"
