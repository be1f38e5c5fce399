"""The relay's wire protocol on real sockets: both ends prove the secret without sending it; every
frame after is encrypted and authenticated under keys of that connection alone, so nobody on the
path reads or alters one; and no frame a peer sends is read beyond the kind and size the reader
expects."""

import mmap
import os
import socket
import threading
import time

import pytest

from shmsync.errors import AuthenticationError, ProtocolError
from shmsync.relay import wire
from tests.relay.peers import server_handshake
from tests.waiting import STUCK_S, wait_for

SECRET = b"thirty-two bytes or more of relay secret"
PAYLOAD = b"the weights of version seven, in clear: " * 100


def _pair():
    return socket.socketpair()


def _run(fn, *args, **kwargs):
    """Run ``fn(*args)`` in a thread; returns a callable giving its result or raising its error."""
    out = {}

    def target():
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()

    def result():
        thread.join(10)
        assert not thread.is_alive(), "the other side hung"
        if "error" in out:
            raise out["error"]
        return out.get("value")

    return result


def _links(encrypt=True, secret=SECRET, client_secret=SECRET):
    """A linked (server, client) pair after a real handshake over a socket pair."""
    a, b = _pair()
    served = _run(server_handshake, a, secret, 5, encrypt=encrypt)
    keys = wire.client_handshake(b, client_secret, 5, encrypt=encrypt)
    return wire.Link(a, "client", served()), wire.Link(b, "server", keys)


class Path:
    """A connection through a man in the middle: a thread per direction passes each byte on, and
    may record it or replace it (``alter(direction, data) -> data``)."""

    def __init__(self, alter=None):
        self.server, inner_server = _pair()
        inner_client, self.client = _pair()
        self.crossed = bytearray()
        self.alter = alter or (lambda direction, data: data)
        for direction, src, dst in (("down", inner_server, inner_client), ("up", inner_client, inner_server)):
            threading.Thread(target=self._pump, args=(direction, src, dst), daemon=True).start()

    def _pump(self, direction, src, dst):
        try:
            while data := src.recv(65536):
                self.crossed.extend(data)
                dst.sendall(self.alter(direction, data))
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def test_both_ends_prove_the_secret_and_it_never_crosses_the_wire():
    path = Path()
    done = _run(server_handshake, path.server, SECRET, 5)
    wire.client_handshake(path.client, SECRET, 5)
    done()
    want = wire.SERVER_HELLO + wire.CLIENT_HELLO + 1 + wire.MAC_BYTES  # the answer: status, proof
    wait_for(lambda: len(path.crossed) >= want, timeout=10, what="the pipe to pass it all")
    assert len(path.crossed) == want == 48 + 81 + 33
    assert SECRET not in path.crossed and SECRET[:16] not in path.crossed


def test_frames_are_unreadable_on_the_path_and_each_connection_has_keys_of_its_own():
    sealed = []
    for _ in range(2):
        path = Path()
        served = _run(server_handshake, path.server, SECRET, 5)
        client = wire.Link(path.client, "server", wire.client_handshake(path.client, SECRET, 5))
        server = wire.Link(path.server, "client", served())
        start = len(path.crossed)
        client.send(b"DATA", PAYLOAD)
        kind, n = server.recv_frame({b"DATA": len(PAYLOAD)}, 5)
        assert (kind, n, server.recv_payload(5)) == (b"DATA", len(PAYLOAD), PAYLOAD)  # all crossed the path
        on_the_wire = bytes(path.crossed[start:])
        assert b"in clear" not in on_the_wire and PAYLOAD[:32] not in on_the_wire
        sealed.append(on_the_wire[12:])
    assert sealed[0] != sealed[1], "two connections sealed the same bytes alike: their keys are not their own"


@pytest.mark.parametrize("how", ["a flipped byte", "a forged length", "a replayed frame", "a frame of another link"])
def test_a_frame_altered_replayed_or_moved_on_the_path_fails_its_check(how):
    server, client = _links()
    if how == "a flipped byte":
        client.send(b"DATA", PAYLOAD)
        raw = bytearray(server.sock.recv(12 + len(PAYLOAD) + 16, socket.MSG_PEEK | socket.MSG_WAITALL))
        server.sock.recv(len(raw))
        raw[40] ^= 1
        injected = bytes(raw)
    elif how == "a forged length":  # the kind and length are checked too, though in clear
        client.send(b"DATA", PAYLOAD)
        raw = bytearray(server.sock.recv(12 + len(PAYLOAD) + 16, socket.MSG_WAITALL))
        injected = wire.FRAME.pack(b"DATA", len(PAYLOAD) - 1) + bytes(raw[12:-1])
    elif how == "a replayed frame":
        client.send(b"DATA", PAYLOAD)
        raw = server.sock.recv(12 + len(PAYLOAD) + 16, socket.MSG_PEEK | socket.MSG_WAITALL)
        server.recv_frame({b"DATA": len(PAYLOAD)}, 5)
        server.recv_payload(5)  # the real one, taken
        injected = raw  # the same bytes again
    else:
        other_server, other_client = _links()  # same secret, another connection
        other_client.send(b"DATA", PAYLOAD)
        injected = other_server.sock.recv(12 + len(PAYLOAD) + 16, socket.MSG_WAITALL)
    client.sock.sendall(injected)
    server.recv_frame({b"DATA": len(PAYLOAD)}, 5)
    with pytest.raises(AuthenticationError, match="failed its check"):
        server.recv_payload(5)


def test_a_stranger_passing_the_handshake_through_can_neither_read_nor_alter_a_frame():
    """Whoever answers at an address the trainer announced and passes the handshake through to a
    real relay learns no key: the frames it passes on stay sealed, and one it alters is refused."""
    flip = {"on": False}

    def alter(direction, data):
        if flip["on"] and direction == "down":
            data = bytearray(data)
            data[-1] ^= 0xFF
        return bytes(data)

    path = Path(alter)
    served = _run(server_handshake, path.server, SECRET, 5)
    relay = wire.Link(path.client, "trainer", wire.client_handshake(path.client, SECRET, 5))
    trainer = wire.Link(path.server, "relay", served())
    trainer.send(b"DATA", PAYLOAD)
    relay.recv_frame({b"DATA": len(PAYLOAD)}, 5)
    assert relay.recv_payload(5) == PAYLOAD and b"in clear" not in path.crossed
    flip["on"] = True
    trainer.send(b"DATA", PAYLOAD)
    relay.recv_frame({b"DATA": len(PAYLOAD)}, 5)
    with pytest.raises(AuthenticationError, match="failed its check"):
        relay.recv_payload(5)


@pytest.mark.parametrize("client_secret", [b"another secret, of thirty-two bytes too", SECRET[:-1] + b"!"])
def test_a_client_without_the_secret_is_refused(client_secret):
    server, client = _pair()
    served = _run(server_handshake, server, SECRET, 5)
    asked = _run(wire.client_handshake, client, client_secret, 5)
    with pytest.raises(AuthenticationError, match="the peer does not hold the relay secret"):
        served()
    server.close()  # what the relay server does next
    with pytest.raises(AuthenticationError, match="the two hold different secrets"):
        asked()  # the client got nothing but the server's nonce and REFUSED


def test_a_handshake_cut_before_the_answer_is_worth_retrying_not_a_wrong_secret():
    """A server shedding a flood cuts a handshake it has not answered: the client must not take
    that for "the secrets differ" (which ends a relay at once)."""
    server, client = _pair()

    def cut_after_the_hello(sock):
        sock.sendall(wire.ServerSide(SECRET).hello())
        sock.recv(wire.CLIENT_HELLO, socket.MSG_WAITALL)
        sock.close()

    done = _run(cut_after_the_hello, server)
    with pytest.raises(EOFError, match="closed|cut") as caught:
        wire.client_handshake(client, SECRET, 5)
    assert not isinstance(caught.value, AuthenticationError)
    done()


def test_a_server_without_the_secret_is_refused_by_the_client():
    server, client = _pair()

    def pretending_server(sock):
        """Answers the client's proof with one of its own, made with another secret."""
        side = wire.ServerSide(b"a server of another secret, 32 bytes long")
        sock.sendall(side.hello())
        hello = sock.recv(wire.CLIENT_HELLO, socket.MSG_WAITALL)
        transcript = wire.MAGIC + side.nonce + hello[16:48] + hello[48:49]
        sock.sendall(b"\0" + wire._mac(side.secret, b"server", transcript, b"\0"))

    done = _run(pretending_server, server)
    with pytest.raises(AuthenticationError, match="the server does not hold the relay secret"):
        wire.client_handshake(client, SECRET, 5)
    done()


@pytest.mark.parametrize("server_encrypts", [True, False])
def test_both_ends_must_want_the_same_frames(server_encrypts):
    server, client = _pair()
    served = _run(server_handshake, server, SECRET, 5, encrypt=server_encrypts)
    with pytest.raises(AuthenticationError, match="encrypt= must be the same on both ends"):
        wire.client_handshake(client, SECRET, 5, encrypt=not server_encrypts)
    with pytest.raises(AuthenticationError, match="encrypt= must be the same on both ends"):
        served()


def test_plain_frames_inside_a_tunnel_carry_no_tag_and_are_still_checked_for_size():
    server, client = _links(encrypt=False)
    assert server.keys is None and client.keys is None
    client.send(b"DATA", PAYLOAD)
    assert server.recv_frame({b"DATA": len(PAYLOAD)}, 5) == (b"DATA", len(PAYLOAD))
    assert server.recv_payload(5) == PAYLOAD
    client.send(b"DATA", PAYLOAD)
    with pytest.raises(ProtocolError, match="at most 10"):
        server.recv_frame({b"DATA": 10}, 5)


def test_a_peer_that_does_not_speak_the_protocol_is_refused():
    server, client = _pair()
    done = _run(server_handshake, server, SECRET, 5)
    client.recv(wire.SERVER_HELLO)
    client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 60)
    with pytest.raises(AuthenticationError, match="does not speak the shmsync relay protocol"):
        done()


OLD_MAGIC = b"SHMSYNC-RELAY/5\n"  # the protocol of shmsync 0.2.0


def test_a_relay_of_protocol_5_is_refused_at_the_handshake_naming_both_versions():
    """A relay of the release before (protocol 5: no deltas) joining a trainer of this one."""
    assert wire.PROTOCOL == 6 and len(OLD_MAGIC) == len(wire.MAGIC)
    server, client = _pair()
    done = _run(server_handshake, server, SECRET, 5)
    client.recv(wire.SERVER_HELLO)
    client.sendall(OLD_MAGIC + os.urandom(wire.CLIENT_HELLO - len(OLD_MAGIC)))
    with pytest.raises(
        AuthenticationError, match="the peer speaks relay protocol 5, this side 6: run the same shmsync"
    ):
        done()


def test_a_trainer_of_protocol_5_is_refused_by_the_relay_naming_both_versions():
    server, client = _pair()
    server.sendall(OLD_MAGIC + os.urandom(wire.NONCE_BYTES))
    with pytest.raises(AuthenticationError, match="the server speaks relay protocol 5, this side 6"):
        wire.client_handshake(client, SECRET, 5)
    client.close()
    assert server.recv(1024) == b"", "the relay sent its proof to a server of another protocol"


def test_a_silent_peer_is_dropped_at_the_handshake_deadline():
    server, client = _pair()
    began = time.monotonic()
    with pytest.raises(ProtocolError, match="in time"):
        server_handshake(server, SECRET, 0.3)  # the peer stays silent: without the deadline, a hang
    assert time.monotonic() - began < STUCK_S
    client.close()


@pytest.mark.parametrize("encrypt", [True, False])
def test_a_frame_of_an_unexpected_kind_or_size_is_refused_before_its_payload_is_read(encrypt):
    server, client = _links(encrypt)
    client.sock.sendall(wire.FRAME.pack(b"EVIL", 0))
    with pytest.raises(ProtocolError, match=r"sent a b'EVIL' message where only \['JOIN'\] may come"):
        server.recv_frame({b"JOIN": 100}, timeout=5)
    client.sock.sendall(wire.FRAME.pack(b"JOIN", 1 << 40) + b"x" * 10)
    with pytest.raises(
        ProtocolError, match="JOIN message of 1099511627776 bytes; one of at most 100 bytes was expected"
    ):
        server.recv_frame({b"JOIN": 100}, timeout=5)
    assert server.sock.recv(10) == b"x" * 10, "the payload of a refused frame was read"
    client.sock.sendall(wire.FRAME.pack(b"VERS", 8))
    with pytest.raises(ProtocolError, match="VERS message of 8 bytes; one of exactly 16 bytes was expected"):
        server.recv_frame({b"VERS": (16, 16)}, timeout=5)


@pytest.mark.parametrize("encrypt", [True, False])
@pytest.mark.parametrize("into", [False, True])
def test_a_claimed_size_is_never_allocated_ahead_of_its_bytes(encrypt, into):
    """A frame header claiming 64 MiB, then 1 KiB of payload and silence: the receiver holds
    memory for what arrived, not for what was claimed."""
    import tracemalloc

    server, client = _links(encrypt)
    claimed = 64 << 20
    client.sock.sendall(wire.FRAME.pack(b"LYOT", claimed) + os.urandom(1024))
    kind, n = server.recv_frame({b"LYOT": claimed}, timeout=5)
    assert n == claimed
    slot = mmap.mmap(-1, claimed)  # not traced: what is measured is the link's own
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="in time|sent nothing"):
            if into:  # into the caller's buffer (a store's slot): only the sealed bytes are held here
                server.recv_payload_into(memoryview(slot), 0.5)
            else:
                server.recv_payload(0.5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes held for 1 KiB received of a claimed {claimed}"


def test_a_frame_that_is_not_json_where_json_is_due_is_refused():
    server, client = _links()
    client.send(b"JOIN", b"{oops")
    with pytest.raises(ProtocolError, match="not JSON"):
        server.recv_json({b"JOIN": 100}, timeout=5)


def test_a_frame_cut_short_is_an_end_of_link_not_a_hang():
    server, client = _links()
    client.sock.sendall(wire.FRAME.pack(b"JOIN", 10) + b"abc")
    client.sock.close()
    assert server.recv_frame({b"JOIN": 100}, timeout=5) == (b"JOIN", 10)
    with pytest.raises(EOFError):
        server.recv_payload(timeout=5)


def test_a_peer_that_stops_reading_leaves_the_rest_of_a_frame_kept_and_then_takes_it():
    server, client = _links()
    client = wire.Link(client.sock, "server", client.keys, send_timeout=0.2)
    big = os.urandom(32 << 20)  # more than both socket buffers hold
    began = time.monotonic()
    assert not client.send_or_keep(b"DATA", big), "a peer that reads nothing took 32 MB"
    assert 0.15 < time.monotonic() - began < STUCK_S and client.kept is not None
    assert len(client.kept) < len(big) + 16
    got = _run(lambda: (server.recv_frame({b"DATA": len(big)}, 10), server.recv_payload(10))[1])
    assert client.flush_kept(time.monotonic() + STUCK_S)
    assert got() == big and client.kept is None


def test_a_link_that_cannot_hand_its_frame_on_says_so_and_is_broken():
    server, client = _links()
    client = wire.Link(client.sock, "server", client.keys, send_timeout=0.2)
    with pytest.raises(TimeoutError, match="took no bytes"):
        client.send(b"DATA", os.urandom(32 << 20))


@pytest.mark.parametrize(
    "value", [None, ["host"], ["h", 0], ["h", 70000], ["h", True], ["", 1], ["a b", 1], ["x" * 300, 1], "h:1"]
)
def test_an_address_a_peer_sends_is_checked(value):
    with pytest.raises(ProtocolError, match=r"want \[host, port\]"):
        wire.address(value, "an address")
    assert wire.address(["10.0.0.2", 29600], "an address") == ("10.0.0.2", 29600)
