"""The trainer's side of the relay tree: :class:`RelaySender`."""

from __future__ import annotations

import secrets
import sys
from typing import Any

from shmsync.errors import InvalidArgumentError
from shmsync.relay import wire
from shmsync.relay.messages import BUCKET_BYTES, MAX_FANOUT, STOP, choose_fanout
from shmsync.relay.server import Server
from shmsync.watch.remote_rows import ReportBook
from shmsync.writer.store import WeightStore


class RelaySender:
    """Trainer side: relays every new version of ``store`` to the relays that join.

    It takes at most ``fanout`` relays itself and points the others at relays below them
    (see :mod:`shmsync.relay`), once it checked that a relay answers at the address it
    announced; each linked relay gets a thread that sends it the newest version straight from
    its slot of the store (leased, so the trainer does not rewrite it meanwhile), waking on
    each publish. ``publish()`` never waits for any of it. A relay that takes no bytes for
    ``timeout`` seconds, in the middle of a version or not, is dropped (:attr:`dropped`),
    freeing its place and its address; no link ever keeps a copy of the weights.

    Args:
        store: the trainer's store (this process publishes into it).
        address: the address to listen on, and only that one: ``127.0.0.1`` (the default) for
            relays on this machine; this host's address on the network relays reach it by, to
            serve other hosts.
        port: the TCP port (0: any free one, see :attr:`port`).
        secret: the relay secret every relay must prove: at least 32 random bytes (see
            ``shmsync new-secret``). Default: ``$SHMSYNC_RELAY_SECRET``, else the file
            ``$SHMSYNC_RELAY_SECRET_FILE``, else a new random one, printed once to stderr
            (and in :attr:`secret`).
        fanout: relays this sender, and each relay, feeds directly (1: a chain). Default: a
            pipelined chain once a version spans 8 buckets, else 2
            (:func:`~shmsync.relay.messages.choose_fanout`; :attr:`fanout` says which).
        bucket_bytes: a version travels in frames of at most this many bytes (pieces a relay
            checks and forwards as soon as they arrive).
        timeout: seconds a relay may take no bytes before it is dropped.
        handshake_timeout: seconds a connecting relay has to prove the secret and say hello.
        encrypt: encrypt and authenticate every frame (the default). False only for links
            inside a tunnel that does so (WireGuard, SSH): every relay must say the same.
        deltas: send a relay that holds the version before each new one only the leaves that
            changed (the default); False sends every version whole (what a delta saves, measured).

    Example:
        >>> import torch
        >>> from shmsync import WeightStore
        >>> from shmsync.relay import RelaySender
        >>> policy = torch.nn.Linear(4, 2)
        >>> secret = "a random secret of at least 32 bytes, as `shmsync new-secret` makes"
        >>> with WeightStore.create(policy) as store, RelaySender(store, "127.0.0.1", 0, secret=secret) as sender:
        ...     store.publish(policy)  # relays on other hosts receive version 1
        ...     sender.relays  # none joined in this example
        1
        {}
    """

    def __init__(
        self,
        store: WeightStore,
        address: str = "127.0.0.1",
        port: int = 29600,
        *,
        secret: str | bytes | None = None,
        fanout: int | None = None,
        bucket_bytes: int = BUCKET_BYTES,
        timeout: float = 60.0,
        handshake_timeout: float = 5.0,
        encrypt: bool = True,
        deltas: bool = True,
    ) -> None:
        if fanout is None:
            fanout = choose_fanout(store.nbytes, bucket_bytes)
        if isinstance(fanout, bool) or not isinstance(fanout, int) or not 1 <= fanout <= MAX_FANOUT:
            raise InvalidArgumentError(f"fanout must be an int between 1 and {MAX_FANOUT}, got {fanout!r}")
        raw, generated = wire.resolve_secret(secret, generate=True)
        if encrypt:
            wire.Keys(bytes(32), bytes(32))  # the cipher is installed (else a clear ImportError now)
        self.secret = raw.decode(errors="replace")
        self.store = store
        self.fanout = fanout
        self._server = Server(
            address,
            port,
            secret=raw,
            node=secrets.token_hex(8),
            bucket_bytes=bucket_bytes,
            timeout=timeout,
            handshake_timeout=handshake_timeout,
            encrypt=encrypt,
            root=True,
        )
        if generated:
            print(
                f"shmsync.relay: no relay secret was given; this run's is {self.secret}\n"
                f"  pass it to each relay: {wire.SECRET_ENV}=... or a file only you can read, named in "
                f"{wire.SECRET_FILE_ENV}",
                file=sys.stderr,
            )
        self._server.deltas = bool(deltas)
        self._server.book = ReportBook(store.name, write_file=True, version=lambda: store.version)
        store.remote_rows.add(self._server.book)  # store.readers() lists the readers on every host
        self._server.set_store(store)
        self._server.start(store.memory.layout_description, [], fanout)

    @property
    def address(self) -> tuple[str, int]:
        """The address and port it listens on."""
        return self._server.address

    @property
    def port(self) -> int:
        return self._server.address[1]

    @property
    def relays(self) -> dict[int, int]:
        """Relays this sender feeds directly now: relay id -> the last version sent to it."""
        with self._server.changed:
            return {i: c.sent for i, c in self._server.children.items()}

    @property
    def serving(self) -> dict[int, tuple[str, int]]:
        """Relays fed directly whose announced address was checked (others are pointed there)."""
        with self._server.changed:
            return {i: c.serve for i, c in self._server.children.items() if c.verified and c.serve is not None}

    @property
    def bytes_sent(self) -> dict[int, int]:
        """Bytes sent to each relay fed directly now (frames and payloads), by relay id."""
        with self._server.changed:
            return {i: c.link.bytes_sent for i, c in self._server.children.items()}

    @property
    def dropped(self) -> dict[int, str]:
        """Relays dropped (the last 256): relay id -> why (it went away, took no bytes for
        ``timeout`` seconds, broke the protocol, holds another model)."""
        with self._server.changed:
            return dict(self._server.dropped)

    @property
    def refused(self) -> int:
        """Connections refused before they became a relay (no secret, a broken or silent
        handshake, too many at once)."""
        return self._server.refused

    def close(self) -> None:
        """Tell every relay to stop, and stop listening; returns within 2 seconds."""
        self._server.close(STOP)
        self.store.remote_rows.discard(self._server.book)
        self._server.book.close()

    def __enter__(self) -> RelaySender:
        return self

    def __exit__(self, *_exc: Any) -> None:
        self.close()
