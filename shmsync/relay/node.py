"""A host's side of the relay tree: :class:`Relay` joins the trainer's tree (directly, or where
it is pointed) and publishes each version it receives into this host's store."""

from __future__ import annotations

import random
import secrets
import time
from typing import Any, TypeGuard, cast

from shmsync.core.header import MAX_LAYOUT_BYTES
from shmsync.errors import (
    AuthenticationError,
    ProtocolError,
    RelayError,
    ShmSyncError,
    StoreCorruptError,
    StoreNotFoundError,
    TrainerGoneError,
    WeightMismatchError,
)
from shmsync.relay import wire
from shmsync.relay.incoming import Left, Received, follow
from shmsync.relay.messages import (
    BUCKET_BYTES,
    BYE,
    CONF,
    HAVE,
    JOIN,
    LYOT,
    MAX_BUCKET_BYTES,
    MAX_DEPTH,
    MAX_FANOUT,
    MAX_HOPS,
    MISM,
    REDI,
    STOP,
    describe_difference,
    log,
)
from shmsync.relay.reports import Reporter
from shmsync.relay.server import Server
from shmsync.store.layout import Layout
from shmsync.store.reader_table import Transfer
from shmsync.watch.remote_rows import HostRows, ReportBook, own_rows
from shmsync.writer.store import WeightStore


class Relay:
    """Host side: joins the trainer's :class:`RelaySender` (directly, or through the relay it is
    pointed at) and publishes each version it receives into this host's store, under the
    trainer's version number; relays below it get each piece as it arrives.

    Args:
        address, port: where the trainer's :class:`RelaySender` listens.
        store: the name of this host's store. If it exists, its layout must be the trainer's
            (else :class:`~shmsync.WeightMismatchError`, nothing written); if not, it is created
            from the first version received (so readers here never see any other first version).
        secret: the relay secret (default: ``$SHMSYNC_RELAY_SECRET``, else the file
            ``$SHMSYNC_RELAY_SECRET_FILE``): at least 32 random bytes.
        listen: ``(address, port)`` to take relays of its own on. Default ``"auto"``: this
            host's address towards the trainer, any free port. None: take none (a leaf).
        num_slots: slots of a store created here (4: one for the relays below to send from
            while the next version arrives).
        timeout: seconds to keep trying to reach the trainer, and that a link may stay silent
            (a parent sends keepalives while idle) before this relay re-attaches.
        handshake_timeout: seconds each handshake may take.
        encrypt: as the trainer's :class:`RelaySender` has it (both ends must agree).

    Attributes:
        transfer: what the versions received cost on the link (the last one's bytes, whether it
            came as a delta; the counts), reported to the trainer with this host's readers.

    Example:
        >>> relay = Relay("10.0.0.1", 29600, store="policy")  # doctest: +SKIP
        >>> relay.run()  # until the trainer closes its sender; TrainerGoneError if it dies  # doctest: +SKIP
    """

    def __init__(
        self,
        address: str,
        port: int,
        *,
        store: str,
        secret: str | bytes | None = None,
        listen: tuple[str, int] | str | None = "auto",
        num_slots: int = 4,
        bucket_bytes: int = BUCKET_BYTES,
        timeout: float = 60.0,
        handshake_timeout: float = 5.0,
        encrypt: bool = True,
    ) -> None:
        self.root = (address, int(port))
        self.name = store
        self.secret, _ = wire.resolve_secret(secret)
        if encrypt:
            wire.Keys(bytes(32), bytes(32))  # the cipher is installed (else a clear ImportError now)
        self.encrypt = encrypt
        self.listen = listen
        self.num_slots = num_slots
        self.bucket_bytes = bucket_bytes
        self.timeout, self.handshake_timeout = timeout, handshake_timeout
        self.node = secrets.token_hex(8)
        self.store: WeightStore | None = None
        self.received = 0
        self.parent: tuple[str, int] | None = None  # where versions come from now
        self.attachments = 0  # how many times it (re-)attached
        self.server: Server | None = None
        self.description: bytes | None = None
        self.layout: Layout | None = None
        self.bucket = MAX_BUCKET_BYTES  # the most bytes the parent puts in one frame
        self.transfer: Transfer | None = None  # what the versions received cost on the link (reported upstream)

    @property
    def serving(self) -> tuple[str, int] | None:
        """The address relays below this one attach to (None for a leaf, or before :meth:`run`)."""
        return self.server.address if self.server is not None else None

    def run(self, max_versions: int | None = None) -> None:
        """Receive until the trainer closes its sender (or ``max_versions`` were published here),
        re-attaching through the trainer whenever the relay it receives from goes away.

        Raises:
            TrainerGoneError: the trainer cannot be reached any more (its process died), or no
                version arrived for ``timeout`` seconds while re-attaching.
            WeightMismatchError: this host's store holds another model; nothing written.
            AuthenticationError: the trainer (or a relay it pointed at) holds another secret,
                or wants the other mode; or the trainer's frames failed their check.
            ProtocolError: the trainer itself broke the protocol (nothing it sent was published).
        """
        try:
            lost: list[float] = []  # when links were lost since the last version received
            while max_versions is None or self.received < max_versions:
                link = self._attach()
                received = self.received
                book = self.server.book if self.server is not None else ReportBook()
                reporter = Reporter(link, self.node, self._own_rows, book)
                try:
                    if follow(self, link, max_versions) == "stopped" and self.server is not None:
                        self.server.close(STOP)  # the trainer closed its sender: the tree ends
                    return
                except (ProtocolError, AuthenticationError):
                    if self.parent == self.root:
                        raise  # the trainer itself broke the protocol: no other parent to try
                    self._lost(link, lost, received, "it broke the protocol")
                except (EOFError, OSError, Left) as e:
                    self._lost(link, lost, received, e)
                finally:
                    reporter.close()
                    link.close()
        except BaseException:
            if self.server is not None:
                self.server.close(BYE)  # the relays below find another parent
            raise

    def note_received(self, got: Received) -> None:
        """A version was published here: count what it cost on the link (see :attr:`transfer`)."""
        t = self.transfer or Transfer(-1, 0, False, 0, 0, 0)
        self.transfer = Transfer(
            got.version,
            got.wire_bytes,
            got.delta,
            t.deltas + got.delta,
            t.wholes + (not got.delta),
            t.total_bytes + got.wire_bytes,
        )

    def _own_rows(self) -> HostRows | None:
        """This host's readers, for the report to the parent (None before this host's store exists)."""
        store = self.store
        if store is None or store.closed:
            return None
        try:
            table = store.readers(processes=True, memory=False)
        except ShmSyncError:
            return None
        return own_rows(self.name, self.node, [*table.rows, *table.gone], self.transfer)

    def _lost(self, link: wire.Link, lost: list[float], received: int, why: Any) -> None:
        """Note a lost parent; give up once links keep failing for ``timeout`` seconds without a
        version arriving (a tree that never delivers is as good as a dead trainer)."""
        now = time.monotonic()
        if self.received > received:
            lost.clear()
        lost.append(now)
        if now - lost[0] > self.timeout:
            raise TrainerGoneError(
                f"relay {self.name!r}: no version arrived for {self.timeout} s while re-attaching ({why})"
            )
        log.warning("relay %r: lost %s (%s); re-attaching through the trainer", self.name, link.peer, why)
        time.sleep(min(1.0, 0.05 * 2 ** (len(lost) - 1)))  # links that keep failing: back off

    # -- attaching ------------------------------------------------------------------------------
    def _attach(self) -> wire.Link:
        """An admitted link to a node of the tree: the trainer, or where it points."""
        deadline = time.monotonic() + self.timeout
        target, seen, direct, failures = self.root, {self.root}, False, 0
        while True:
            link = self._connect(target, deadline, failures)
            if link is None:  # the relay it was pointed at is gone, or did not answer: ask again
                target, seen, failures = self.root, {self.root}, failures + 1
                continue
            admitted, redirect, why = self._ask_to_join(link, target, direct)
            if admitted:
                self.parent = target
                self.attachments += 1
                return link
            link.close()
            if redirect is not None and redirect not in seen and len(seen) <= MAX_HOPS:
                seen.add(redirect)
                target = redirect
                continue
            if redirect is not None:
                # Pointed back where it was, or on and on: a relay holding the secret announced
                # an address that leads round a circle. The trainer takes it on itself.
                if direct and target == self.root:
                    raise ProtocolError("the trainer pointed elsewhere a relay that asked to be taken on directly")
                log.warning("relay %r: pointed round a circle (%s:%s again); asking the trainer directly",
                            self.name, *redirect)  # fmt: skip
                target, seen, direct = self.root, {self.root}, True
                continue
            self._give_up_after(deadline, why)
            log.warning("relay %r: attaching through %s:%s failed (%s); trying the trainer", self.name, *target, why)
            failures += 1
            _back_off(failures)
            target, seen = self.root, {self.root}

    def _ask_to_join(self, link: wire.Link, target: tuple[str, int], direct: bool) -> tuple[bool, Any, Exception]:
        """Ask ``target`` over ``link`` to take this relay on: ``(admitted, where it points instead,
        why not)``; the link is closed if anything failed.

        Raises:
            WeightMismatchError: the tree carries another layout.
            ProtocolError, AuthenticationError: the trainer itself broke the protocol.
        """
        try:
            admitted, redirect = self._join(link, direct and target == self.root)
        except WeightMismatchError:
            link.close()
            raise
        except (ProtocolError, AuthenticationError, EOFError, OSError, ValueError) as e:
            link.close()
            if target == self.root and isinstance(e, (ProtocolError, AuthenticationError)):
                raise  # the trainer itself broke the protocol
            return False, None, e
        return admitted, redirect, ProtocolError(f"{link.peer} is below this relay in the tree (a cycle)")

    def _connect(self, target: tuple[str, int], deadline: float, failures: int = 0) -> wire.Link | None:
        """A link to ``target`` that passed the handshake; None (having backed off after
        ``failures`` failed tries) if it cannot be had now, and then the trainer is asked again:
        a server shedding a flood cuts handshakes before it answers them.

        Raises:
            TrainerGoneError: nobody listens at the trainer's address, or the deadline passed.
            AuthenticationError: the other end holds another secret or wants the other mode.
        """
        try:
            return wire.connect(
                *target, self.secret, self.handshake_timeout, encrypt=self.encrypt, send_timeout=self.timeout
            )
        except ConnectionRefusedError as e:
            if target == self.root:
                raise TrainerGoneError(f"relay {self.name!r}: nobody listens at {target[0]}:{target[1]}") from e
            self._give_up_after(deadline, e)
        except AuthenticationError:
            raise
        except (RelayError, OSError) as e:
            self._give_up_after(deadline, e)
            _back_off(failures + 1)
        return None

    def _join(self, link: wire.Link, direct: bool = False) -> tuple[bool, tuple[str, int] | None]:
        """Ask to join at ``link``'s end (``direct``: whatever its fan-out): ``(True, None)`` once
        admitted, ``(False, address)`` if pointed elsewhere, ``(False, None)`` if admitting would
        make a cycle."""
        if self.server is None and self.listen is not None:
            self.server = self._make_server(link)
        doc = {"node": self.node, "serve": self.serving and list(self.serving)}
        link.send_json(JOIN, {**doc, "direct": True} if direct else doc)
        kind, _ = link.recv_frame({REDI: wire.MAX_JSON_BYTES, LYOT: MAX_LAYOUT_BYTES}, self.handshake_timeout)
        if kind == REDI:
            doc = link.recv_payload_json(kind, self.handshake_timeout)
            return False, wire.address(doc.get("to") if isinstance(doc, dict) else None, "a redirect")
        return self._admitted(link, link.recv_payload(self.handshake_timeout)), None

    def _give_up_after(self, deadline: float, error: BaseException) -> None:
        if time.monotonic() > deadline:
            raise TrainerGoneError(
                f"relay {self.name!r}: could not attach to the trainer's tree within {self.timeout} s ({error})"
            ) from error

    def _make_server(self, link: wire.Link) -> Server:
        host, port = (link.sock.getsockname()[0], 0) if self.listen == "auto" else cast(tuple[str, int], self.listen)
        return Server(
            host,
            port,
            secret=self.secret,
            node=self.node,
            bucket_bytes=self.bucket_bytes,
            timeout=self.timeout,
            handshake_timeout=self.handshake_timeout,
            encrypt=self.encrypt,
            root=False,
        )

    def _admitted(self, link: wire.Link, description: bytes) -> bool:
        """Check the layout and the tree path the parent sent, answer with the version this host
        holds; False if admitting would make a cycle. Raises WeightMismatchError (after telling
        the parent) when this host's store holds another model."""
        layout = self._layout_of(description, link.peer)
        _, conf = link.recv_json({CONF: wire.MAX_JSON_BYTES}, self.handshake_timeout)
        fanout, path, bucket = check_conf(conf, link.peer)
        if self.node in path:
            return False
        store = self._host_store(description, link)
        link.send_json(HAVE, {"version": store.version if store is not None else -1})
        self.description, self.layout, self.bucket = description, layout, bucket
        if self.server is not None:
            if store is not None:
                self.server.set_store(store)
            self.server.start(description, path, fanout)
        return True

    def _layout_of(self, description: bytes, peer: str) -> Layout:
        """The layout the parent sent, parsed once (not at every re-attach); always the same one."""
        if self.description is not None:
            if description != self.description:
                raise ProtocolError(f"{peer} serves another layout than the one this relay had")
            return cast(Layout, self.layout)  # parsed with the description
        try:
            return Layout.from_json(description, f"the layout {peer} sent")[0]
        except StoreCorruptError as e:
            raise ProtocolError(str(e)) from None

    def _host_store(self, description: bytes, link: wire.Link) -> WeightStore | None:
        """This host's store, if it exists (None: made from the first version), checked to hold
        the trainer's model; else the parent is told, and WeightMismatchError raised."""
        if self.store is None:
            try:
                self.store = WeightStore.attach(self.name)
            except StoreNotFoundError:
                self.store = None
        if self.store is not None and self.store.memory.layout_description != description:
            why = describe_difference(self.store.memory.layout_description, description)
            link.send_json(MISM, {"why": why})
            raise WeightMismatchError(
                f"relay: this host's store {self.name!r} holds another model than the trainer's: {why}; nothing written"
            )
        return self.store

    def close(self) -> None:
        """Stop feeding relays below (they re-attach elsewhere) and let go of this host's store."""
        if self.server is not None:
            self.server.close(BYE)
        if self.store is not None:
            self.store.close()


def _back_off(failures: int) -> None:
    """Wait before trying again: doubling from 50 ms to 1 s, jittered so relays cut together
    do not come back together."""
    time.sleep(min(1.0, 0.05 * 2 ** min(failures - 1, 5)) * random.uniform(0.5, 1.0))


def check_conf(conf: Any, peer: str) -> tuple[int, list[str], int]:
    """The tree's settings a parent sent (fan-out, the path of node ids down to it, its bucket),
    checked. Raises ProtocolError naming what is off."""
    fanout, path, bucket = (conf.get(k) if isinstance(conf, dict) else None for k in ("fanout", "path", "bucket"))
    ok = (
        _is_int(fanout)
        and 1 <= fanout <= MAX_FANOUT
        and isinstance(path, list)
        and 0 < len(path) <= MAX_DEPTH
        and all(isinstance(p, str) and len(p) == 16 for p in path)
        and _is_int(bucket)
        and 1 <= bucket <= MAX_BUCKET_BYTES
    )
    if not ok:
        raise ProtocolError(f"{peer} sent the tree's settings as {str(conf)[:100]}")
    return cast(int, fanout), cast(list[str], path), cast(int, bucket)


def _is_int(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)
