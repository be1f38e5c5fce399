"""The relay's wire protocol: TCP links on which both ends proved the relay secret, carrying
frames nobody else can read or alter (no torch here).

**Handshake.** Each side proves it holds the secret with an HMAC-SHA256 over the whole
transcript, with a fresh nonce of its own; the secret itself never crosses the wire::

    server -> client   MAGIC, Ns (32 random bytes)
    client -> server   MAGIC, Nc (32 random bytes), mode (1 byte), HMAC(secret, "client" | T)
    server -> client   status (1 byte), HMAC(secret, "server" | T | status)
                       or REFUSED (1 byte), then it hangs up

where ``T = MAGIC | Ns | Nc | mode``, ``mode`` is 1 for encrypted frames and 0 for plain ones
(both ends must want the same: status 1 says they do not). A server answers a wrong proof with
the one byte REFUSED and hangs up, having sent nothing else but its nonce, so a client tells
"the secrets differ" (give up) from "cut before the answer" (a server shedding a flood, or the
network: try again). A stranger who answers at an address and passes a real handshake through
learns two nonces and two MACs, nothing it can use.

**Keys.** HKDF-SHA256 of the secret, salted with ``Ns | Nc`` (fresh on both sides, so every
connection has keys of its own), gives one AES-256-GCM key per direction.

**Frames.** A 4-letter kind and an 8-byte big-endian payload length, in clear, then the
payload encrypted and authenticated, with the kind and length as associated data::

    kind (4) | length n (8) | AES-GCM(key, nonce = 0 (4) | counter (8), payload, aad = kind | n) (n + 16)

Each direction counts its frames from 0, so a frame altered, cut, replayed, reordered or moved
from another connection fails its check (:class:`~shmsync.errors.AuthenticationError`), and the
link ends. A reader names the kinds it accepts at that point and the most bytes each may carry;
any other kind or a longer one is refused before a byte of its payload is read, so a peer can
never make this side allocate or receive more than it expects. Every wait has a deadline.

**Sealed frames** carry pieces of a version sealed once for the whole tree
(:mod:`shmsync.relay.sealing`): they go as they are, without the link's own seal, and are
checked by the sealing's key when opened.

**Plain frames**, ``encrypt=False`` on both ends, are for links inside a tunnel that already
encrypts and authenticates (WireGuard, SSH): the same frames without the 16-byte tag, checked
for kind and size but readable and alterable on the path. Never across a network you do not
trust.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import select
import socket
import struct
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shmsync.errors import (
    AuthenticationError,
    LinkClosedError,
    LinkTimeoutError,
    MissingExtraError,
    ProtocolError,
    RelayError,
)
from shmsync.tools.secret_file import (  # noqa: F401 (re-exported: the relay's callers read secrets from here)
    MIN_SECRET_BYTES,
    SECRET_ENV,
    SECRET_FILE_ENV,
    read_secret_file,
    resolve_secret,
)

PROTOCOL = 6
MAGIC_PREFIX = b"SHMSYNC-RELAY/"
MAGIC = MAGIC_PREFIX + b"%d\n" % PROTOCOL
NONCE_BYTES = 32
MAC_BYTES = 32
TAG_BYTES = 16
SERVER_HELLO = len(MAGIC) + NONCE_BYTES
CLIENT_HELLO = len(MAGIC) + NONCE_BYTES + 1 + MAC_BYTES
FRAME = struct.Struct(">4sQ")
MAX_JSON_BYTES = 64 << 10
ACCEPTED, OTHER_MODE, REFUSED = 0, 1, 2
KEY_INFO = b"shmsync relay 2 keys"


class Keys:
    """The two AES-256-GCM keys of one connection and the frame counters of each direction."""

    def __init__(self, send_key: bytes, recv_key: bytes) -> None:
        aead = aead_class()
        self.send, self.recv = aead(send_key), aead(recv_key)
        self.sent = self.received = 0

    def next_send_nonce(self) -> bytes:
        nonce, self.sent = self.sent.to_bytes(12, "big"), self.sent + 1
        return nonce

    def next_recv_nonce(self) -> bytes:
        nonce, self.received = self.received.to_bytes(12, "big"), self.received + 1
        return nonce


def aead_class():
    """cryptography's AES-GCM, or an ImportError that says how to get it."""
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:  # pragma: no cover - depends on the environment
        raise MissingExtraError(
            "encrypted relay links need the cryptography package: pip install 'shmsync[relay]' (or, inside a "
            "tunnel that encrypts, encrypt=False on both ends)"
        ) from None
    return AESGCM


def derive_key(secret: bytes, salt: bytes, info: bytes, length: int = 32) -> bytes:
    """HKDF-SHA256 of the secret: ``length`` bytes of key material for ``salt`` and ``info``."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(hashes.SHA256(), length, salt=salt, info=info).derive(secret)


def _derive(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> tuple[bytes, bytes]:
    """(client-to-server key, server-to-client key) of one connection."""
    okm = derive_key(secret, server_nonce + client_nonce, KEY_INFO, 64)
    return okm[:32], okm[32:]


def open_checked(aead: Any, nonce: bytes, sealed: memoryview, aad: bytes, into: memoryview, why: str) -> None:
    """Decrypt ``sealed`` into ``into``; AuthenticationError(``why``) if it fails its check (then
    ``into`` may hold bytes: the cipher writes as it checks)."""
    try:
        aead.decrypt_into(nonce, sealed, aad, into)
    except Exception as e:  # cryptography's InvalidTag
        if type(e).__name__ != "InvalidTag":
            raise
        raise AuthenticationError(why) from None


def speaks(hello: bytes) -> str:
    """What a hello that is not this protocol's says of its sender, in words: another version of
    the relay protocol (another shmsync release), or none at all."""
    if hello.startswith(MAGIC_PREFIX):
        number = hello[len(MAGIC_PREFIX) : len(MAGIC)].rstrip(b"\n")
        if number.isdigit():
            return (
                f"speaks relay protocol {int(number)}, this side {PROTOCOL}: run the same shmsync release on the "
                "trainer and on every relay"
            )
    return f"does not speak the shmsync relay protocol (version {PROTOCOL})"


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


@dataclass
class ServerSide:
    """The server's half of one handshake, as a state machine (the relay's acceptor drives many at
    once on non-blocking sockets).

    Args:
        secret: the relay secret.
        encrypt: whether this server wants encrypted frames.
    """

    secret: bytes
    encrypt: bool = True

    def __post_init__(self) -> None:
        self.nonce = secrets.token_bytes(NONCE_BYTES)

    def hello(self) -> bytes:
        return MAGIC + self.nonce

    def answer(self, client_hello: bytes) -> tuple[bytes, Keys | None]:
        """The answer to send to ``client_hello`` (:data:`CLIENT_HELLO` bytes), and the connection's
        keys (None for plain frames).

        Raises:
            AuthenticationError: the client does not speak the protocol or does not hold the
                secret (send it nothing: hang up), or wants the other mode (send the answer, which
                tells it so, then hang up).
        """
        if len(client_hello) != CLIENT_HELLO or client_hello[: len(MAGIC)] != MAGIC:
            raise AuthenticationError(f"the peer {speaks(client_hello)}")
        theirs = client_hello[len(MAGIC) : len(MAGIC) + NONCE_BYTES]
        mode, proof = client_hello[len(MAGIC) + NONCE_BYTES : -MAC_BYTES], client_hello[-MAC_BYTES:]
        transcript = MAGIC + self.nonce + theirs + mode
        if not hmac.compare_digest(proof, _mac(self.secret, b"client", transcript)):
            raise Refused("the peer does not hold the relay secret", bytes([REFUSED]))
        status = bytes([ACCEPTED if mode == bytes([self.encrypt]) else OTHER_MODE])
        reply = status + _mac(self.secret, b"server", transcript, status)
        if status[0] != ACCEPTED:
            raise _OtherMode(reply, self.encrypt)
        if not self.encrypt:
            return reply, None
        c2s, s2c = _derive(self.secret, self.nonce, theirs)
        return reply, Keys(s2c, c2s)


class Refused(AuthenticationError):
    """A handshake the server refuses; ``reply`` is what it sends before it hangs up."""

    def __init__(self, message: str, reply: bytes) -> None:
        super().__init__(message)
        self.reply = reply


class _OtherMode(Refused):
    def __init__(self, reply: bytes, encrypt: bool) -> None:
        want = "encrypted" if encrypt else "plain"
        super().__init__(f"the peer holds the secret but wants {'plain' if encrypt else 'encrypted'} frames, "
                         f"this side {want} ones (encrypt= must be the same on both ends)", reply)  # fmt: skip


def client_handshake(sock: socket.socket, secret: bytes, timeout: float, *, encrypt: bool = True) -> Keys | None:
    """Run the client's side of the handshake on a connected socket; the connection's keys.

    Raises:
        AuthenticationError: the server refused this side's proof (the secrets differ), did not
            prove the secret (it may be a stranger's; nothing was accepted from it), or wants the
            other mode.
        ProtocolError, EOFError, OSError: it broke off (a server shedding a flood cuts before it
            answers) or took longer than ``timeout`` seconds: worth trying again.
    """
    deadline = time.monotonic() + timeout
    got = _recv_exactly(sock, SERVER_HELLO, deadline, "handshake")
    if got[: len(MAGIC)] != MAGIC:
        raise AuthenticationError(f"the server {speaks(got)}")
    theirs, ours, mode = got[len(MAGIC) :], secrets.token_bytes(NONCE_BYTES), bytes([encrypt])
    transcript = MAGIC + theirs + ours + mode
    sock.sendall(MAGIC + ours + mode + _mac(secret, b"client", transcript))
    try:
        status = _recv_exactly(sock, 1, deadline, "handshake")
    except ConnectionResetError as e:
        raise LinkClosedError(f"handshake: the server cut the connection before it answered ({e})") from None
    if status[0] == REFUSED:
        raise AuthenticationError("the server refused this side's proof: the two hold different secrets")
    proof = _recv_exactly(sock, MAC_BYTES, deadline, "handshake")
    if not hmac.compare_digest(proof, _mac(secret, b"server", transcript, status)):
        raise AuthenticationError("the server does not hold the relay secret")
    if status[0] != ACCEPTED:
        raise AuthenticationError(
            f"the server holds the secret but wants {'plain' if encrypt else 'encrypted'} frames, this side "
            f"{'encrypted' if encrypt else 'plain'} ones (encrypt= must be the same on both ends)"
        )
    if not encrypt:
        return None
    c2s, s2c = _derive(secret, theirs, ours)
    return Keys(c2s, s2c)


def _recv_exactly(sock: socket.socket, n: int, deadline: float, what: str) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProtocolError(f"{what}: the peer sent {got} of {n} bytes in time")
        sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:])
        except TimeoutError:
            raise ProtocolError(f"{what}: the peer sent {got} of {n} bytes in time") from None
        if k == 0:
            raise LinkClosedError(f"{what}: the peer closed the connection")
        got += k
    return bytes(buf)


GROW_FROM = 64 << 10  # a receive buffer's first size; it then at most doubles what arrived


def _recv_growing(
    recv_into: Callable[[memoryview, float | None], int],
    buf: bytearray,
    total: int,
    deadline: float | None,
    peer: str,
) -> bytearray:
    """Receive ``total`` bytes into the front of ``buf`` (returned, grown as needed). It grows with
    the bytes that arrive, to at most twice them (or :data:`GROW_FROM`): a peer that claims a
    large frame and sends little costs little."""
    got = 0
    while got < total:
        want = min(total, max(GROW_FROM, 2 * got))
        if len(buf) < want:
            buf.extend(bytes(want - len(buf)))
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise ProtocolError(f"{peer} sent {got} of {total} bytes in time")
        with memoryview(buf)[got:want] as view:
            got += recv_into(view, left)
    return buf


def tune(sock: socket.socket) -> None:
    """No Nagle delay, and TCP keepalives so that a peer whose host vanished is noticed (~30 s)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 15), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _timeval(seconds: float | None) -> bytes:
    seconds = 0.0 if seconds is None else max(seconds, 0.001)
    return struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))


class Link:
    """One connection after the handshake: frames out, checked frames in.

    The socket is left blocking and times out through the kernel (``SO_RCVTIMEO``, and
    ``SO_SNDTIMEO`` for sends), set only when the timeout changes: a receive is one system call.

    Args:
        sock: the connected socket (after the handshake).
        peer: how messages name the other end (``"10.0.0.2:41234"``).
        keys: the connection's keys (from the handshake); None for plain frames.
        send_timeout: seconds a send may wait for the peer to take a byte (None: however long):
            :meth:`send` then breaks the link, :meth:`send_or_keep` keeps the rest of the frame.
    """

    def __init__(self, sock: socket.socket, peer: str, keys: Keys | None = None, send_timeout: float | None = None):
        self.sock = sock
        self.peer = peer
        self.keys = keys
        self.bytes_sent = 0
        self.bytes_received = 0
        sock.settimeout(None)
        self._timeout: float | None = None  # the socket's receive timeout now (None: none)
        self._frame: tuple[bytes, int] | None = None  # a frame whose payload is still to be read
        self._out = bytearray()  # sealed payloads go out from here
        self._in = bytearray()  # sealed payloads come in here
        self.kept: memoryview | None = None  # the rest of a frame a stalled peer did not take
        self.send_timeout = send_timeout
        if send_timeout is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send_timeout))

    # -- out -----------------------------------------------------------------------------------
    def send(self, kind: bytes, payload: bytes | memoryview = b"") -> None:
        """Send one frame.

        Raises:
            TimeoutError: the peer took no bytes for the send timeout (the link is then broken).
            OSError: the peer went away.
        """
        if not self.send_or_keep(kind, payload):
            self.close()
            raise LinkTimeoutError(f"{self.peer} took no bytes for {self.send_timeout} s")

    def send_or_keep(self, kind: bytes, payload: bytes | memoryview = b"", *, sealed: bool = False) -> bool:
        """Send one frame; False if the peer took no bytes for the send timeout, in which case the
        unsent rest of the frame is kept here (a copy of at most one frame, so that ``payload`` may
        be let go) to be sent by :meth:`flush_kept` before anything else. ``sealed``: the payload
        is a piece sealed for the whole tree (:mod:`shmsync.relay.sealing`), sent as it is.

        Raises:
            OSError: the peer went away.
        """
        if self.kept is not None:
            raise RelayError(f"a frame to {self.peer} is still to be sent (flush_kept first)")
        n = len(payload)
        header = FRAME.pack(kind, n)
        if self.keys is not None and not sealed:
            if len(self._out) < n + TAG_BYTES:
                self._out = bytearray(n + TAG_BYTES)
            boxed = memoryview(self._out)[: n + TAG_BYTES]
            self.keys.send.encrypt_into(self.keys.next_send_nonce(), payload, header, boxed)
            payload = boxed
        self.bytes_sent += FRAME.size + len(payload)
        sent = self._send_some(header, payload)
        if sent == FRAME.size + len(payload):
            return True
        # Stalled: keep the rest (a copy: a sealed piece's buffer goes to the next version).
        rest = bytearray(header[sent:]) if sent < FRAME.size else bytearray()
        done = max(0, sent - FRAME.size)
        rest += payload[done:]
        self.kept = memoryview(rest)
        return False

    def flush_kept(self, deadline: float, stop: Callable[[], bool] = lambda: False) -> bool:
        """Send the rest of a frame a stalled peer did not take, waiting for it to take bytes
        again until ``deadline`` (``time.monotonic()``) or ``stop()``; True once it is all sent."""
        while self.kept is not None:
            if stop() or time.monotonic() > deadline:
                return False
            _, writable, _ = select.select([], [self.sock], [], min(0.2, max(0.0, deadline - time.monotonic())))
            if not writable:
                continue
            try:
                n = self.sock.send(self.kept)
            except BlockingIOError:
                continue
            self.kept = self.kept[n:] if n < len(self.kept) else None
        return True

    def _send_some(self, header: bytes, payload: bytes | memoryview) -> int:
        """Send header and payload; how many bytes went before the peer took none for the send
        timeout (all of them, if it never stalled)."""
        # Header and payload in one system call: two sends would let the peer wake on the header
        # and wait, a scheduler slice on a busy host, for the rest.
        total, sent = FRAME.size + len(payload), 0
        with memoryview(payload) as view:
            while sent < total:
                try:
                    if sent < FRAME.size:
                        sent += self.sock.sendmsg([header[sent:], view]) if len(view) else self.sock.send(header[sent:])
                    else:
                        sent += self.sock.send(view[sent - FRAME.size :])
                except BlockingIOError:  # SO_SNDTIMEO ran out with no byte taken: the peer stalls
                    return sent
        return sent

    def send_json(self, kind: bytes, doc: Any) -> None:
        self.send(kind, json.dumps(doc, separators=(",", ":")).encode())

    # -- in ------------------------------------------------------------------------------------
    def recv_frame(
        self, allowed: Mapping[bytes, int | tuple[int, int]], timeout: float | None = None
    ) -> tuple[bytes, int]:
        """The next frame's kind and length, which must be one of ``allowed`` (kind -> the most
        bytes it may carry, or ``(fewest, most)``); its payload must be read next, whole
        (:meth:`recv_payload`, :meth:`recv_payload_into`), except an empty one's, which is
        checked here.

        Raises:
            ProtocolError: another kind, or a length outside what that kind may carry.
            EOFError: the peer closed the link.
        """
        if self._frame is not None:
            raise ProtocolError(f"the payload of the {self._frame[0]!r} frame from {self.peer} was not read")
        kind, length = FRAME.unpack(self._recv_raw(FRAME.size, timeout))
        if kind not in allowed:
            raise ProtocolError(
                f"{self.peer} sent a {kind!r} message where only {sorted(k.decode() for k in allowed)} may come"
            )
        limits = allowed[kind]
        fewest, most = limits if isinstance(limits, tuple) else (0, limits)
        if not fewest <= length <= most:
            limit = f"at most {most}" if fewest == 0 else f"{fewest} to {most}" if fewest != most else f"exactly {most}"
            raise ProtocolError(
                f"{self.peer} sent a {kind.decode()} message of {length} bytes; one of {limit} bytes was expected"
            )
        self._frame = (kind, length)
        if length == 0:
            self.recv_payload_into(memoryview(bytearray()), timeout)  # an empty frame is checked at once
        return kind, length

    def recv_payload(self, timeout: float | None = None) -> bytes:
        """The payload of the frame just read, checked. The buffer grows with the bytes that
        arrive: a length a peer claims is never allocated ahead of its bytes."""
        if self._frame is None:
            return b""
        kind, n = self._frame
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.keys is None:
            payload = _recv_growing(self._recv_into, bytearray(), n, deadline, self.peer)
            self._frame = None
            return bytes(payload)
        self._in = _recv_growing(self._recv_into, self._in, n + TAG_BYTES, deadline, self.peer)
        self._frame = None
        out = bytearray(n)  # the whole frame arrived: now its size is real
        self._open(kind, n, memoryview(out))
        return bytes(out)

    def recv_payload_into(self, view: memoryview, timeout: float | None = None, *, sealed: bool = False) -> None:
        """Receive the payload of the frame just read into ``view`` (of its length exactly), all
        within ``timeout`` seconds (None: however long it takes). With encrypted frames, ``view``
        holds the payload only once this returns: a frame that fails its check may leave bytes
        there (the cipher writes as it checks), so never receive into what others read.
        ``sealed``: a piece sealed for the whole tree, received as it is (its opener checks it).

        Raises:
            AuthenticationError: the frame was altered, cut, replayed or reordered on the way.
        """
        if self._frame is None and len(view) == 0:
            return  # an empty frame: checked as it was read
        if self._frame is None or len(view) != self._frame[1]:
            raise ProtocolError(f"a payload of {len(view)} bytes read where the frame from {self.peer} has another")
        kind, n = self._frame
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.keys is None or sealed:
            self._recv_raw_into(view, deadline)
            self._frame = None
            return
        self._in = _recv_growing(self._recv_into, self._in, n + TAG_BYTES, deadline, self.peer)
        self._frame = None
        self._open(kind, n, view)

    def _open(self, kind: bytes, n: int, view: memoryview) -> None:
        """Check and decrypt the sealed payload just received (the first ``n + TAG_BYTES`` bytes
        of the receive buffer) into ``view``."""
        keys = self.keys
        assert keys is not None  # only sealed links open payloads
        with memoryview(self._in)[: n + TAG_BYTES] as sealed:
            why = (
                f"a {kind.decode(errors='replace')} frame from {self.peer} failed its check: it was altered, "
                "replayed or cut on the way (or the peer is not who proved the secret)"
            )
            open_checked(keys.recv, keys.next_recv_nonce(), sealed, FRAME.pack(kind, n), view, why)

    def recv_json(self, allowed: Mapping[bytes, int], timeout: float | None = None) -> tuple[bytes, Any]:
        """The next frame, whose payload is a JSON document of at most ``allowed[kind]`` bytes."""
        kind, length = self.recv_frame(allowed, timeout)
        return kind, self.recv_payload_json(kind, timeout)

    def recv_payload_json(self, kind: bytes, timeout: float | None = None) -> Any:
        """The payload of the frame just read, parsed as JSON (None if empty)."""
        raw = self.recv_payload(timeout)
        if not raw:
            return None
        try:
            return json.loads(raw.decode())
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise ProtocolError(f"{self.peer} sent a {kind.decode()} message that is not JSON ({e})") from None

    def _recv_raw(self, n: int, timeout: float | None) -> bytes:
        buf = bytearray(n)
        self._recv_raw_into(memoryview(buf), None if timeout is None else time.monotonic() + timeout)
        return bytes(buf)

    def _recv_raw_into(self, view: memoryview, deadline: float | None) -> None:
        got, n = 0, len(view)
        while got < n:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise ProtocolError(f"{self.peer} sent {got} of {n} bytes in time")
            got += self._recv_into(view[got:], left)

    def _recv_into(self, view: memoryview, timeout: float | None) -> int:
        if timeout != self._timeout:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(timeout))
            self._timeout = timeout
        try:
            n = self.sock.recv_into(view)
        except (BlockingIOError, TimeoutError):
            raise ProtocolError(f"{self.peer} sent nothing for over {timeout:.1f} s") from None
        if n == 0:
            raise LinkClosedError(f"{self.peer} closed the link")
        self.bytes_received += n
        return n

    def close(self) -> None:
        """Shut the connection down (a thread blocked on it wakes up) and close it."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def address(value: Any, what: str) -> tuple[str, int]:
    """A ``[host, port]`` pair a peer sent, checked.

    Raises:
        ProtocolError: not a host name or address of at most 255 characters and a port 1-65535.
    """
    if (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and 0 < len(value[0]) <= 255
        and all(c.isalnum() or c in ".-:_%[]" for c in value[0])
        and isinstance(value[1], int)
        and not isinstance(value[1], bool)
        and 0 < value[1] < 65536
    ):
        return value[0], value[1]
    raise ProtocolError(f"{what}: want [host, port], got {str(value)[:100]}")


def connect(
    host: str, port: int, secret: bytes, timeout: float, *, encrypt: bool = True, send_timeout: float | None = None
) -> Link:
    """A new link to the relay server at ``host:port``, both ends having proved the secret.

    Raises:
        ConnectionRefusedError: nobody listens there.
        AuthenticationError: the server does not hold the secret, or wants the other mode.
        RelayError: it did not answer the handshake in ``timeout`` seconds.
    """
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        tune(sock)
        keys = client_handshake(sock, secret, timeout, encrypt=encrypt)
    except (EOFError, ProtocolError) as e:
        sock.close()
        raise RelayError(f"relay server {host}:{port} broke off the handshake ({e})") from e
    except BaseException:
        sock.close()
        raise
    return Link(sock, f"{host}:{port}", keys, send_timeout)
