"""The relay's wire protocol on real sockets: both ends prove the secret without sending it, and
no frame a peer sends is read beyond the kind and size the reader expects."""

import os
import socket
import threading
import time

import pytest

from shmsync import _wire
from shmsync.errors import AuthenticationError, ProtocolError

from helpers import wait_for

SECRET = b"sixteen bytes or more of secret"


def _pair():
    a, b = socket.socketpair()
    return a, b


def _run(fn, *args):
    """Run ``fn(*args)`` in a thread; returns a callable giving its result or raising its error."""
    out = {}

    def target():
        try:
            out["value"] = fn(*args)
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


def _recording_pipe():
    """``(server end, client end, bytes)``: a connection through a thread that records every byte
    crossing it, either way."""
    server, inner_server = _pair()
    inner_client, client = _pair()
    crossed = bytearray()

    def pump(src, dst):
        while data := src.recv(65536):
            crossed.extend(data)
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)

    for src, dst in ((inner_server, inner_client), (inner_client, inner_server)):
        threading.Thread(target=pump, args=(src, dst), daemon=True).start()
    return server, client, crossed


def test_both_ends_prove_the_secret_and_it_never_crosses_the_wire():
    server, client, crossed = _recording_pipe()
    done = _run(_wire.server_handshake, server, SECRET, 5)
    _wire.client_handshake(client, SECRET, 5)
    done()
    wait_for(lambda: len(crossed) >= 2 * len(_wire.MAGIC) + 4 * 32, timeout=10, what="the pipe to pass it all")
    assert len(crossed) == 2 * len(_wire.MAGIC) + 32 + 32 + 32 + 32
    assert SECRET not in crossed and SECRET[:16] not in crossed


@pytest.mark.parametrize("client_secret", [b"another secret of enough bytes", SECRET[:-1] + b"!"])
def test_a_client_without_the_secret_is_refused(client_secret):
    server, client = _pair()
    served = _run(_wire.server_handshake, server, SECRET, 5)
    asked = _run(_wire.client_handshake, client, client_secret, 5)
    with pytest.raises(AuthenticationError, match="the peer does not hold the relay secret"):
        served()
    server.close()  # what the relay server does next
    with pytest.raises(AuthenticationError, match="the two hold different secrets"):
        asked()  # the client got nothing but the server's nonce


def test_a_server_without_the_secret_is_refused_by_the_client():
    server, client = _pair()
    done = _run(_pretending_server, server)
    with pytest.raises(AuthenticationError, match="the server does not hold the relay secret"):
        _wire.client_handshake(client, SECRET, 5)
    done()


def _pretending_server(sock):
    """A server that answers the client's proof with one of its own, made with another secret."""
    nonce = os.urandom(32)
    sock.sendall(_wire.MAGIC + nonce)
    hello = sock.recv(len(_wire.MAGIC) + 64)
    theirs = hello[len(_wire.MAGIC) : len(_wire.MAGIC) + 32]
    sock.sendall(_wire._mac(b"a server of another secret here", b"server", theirs, nonce))


def test_a_peer_that_does_not_speak_the_protocol_is_refused():
    server, client = _pair()
    done = _run(_wire.server_handshake, server, SECRET, 5)
    client.recv(len(_wire.MAGIC) + 32)
    client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 60)
    with pytest.raises(AuthenticationError, match="does not speak the shmsync relay protocol"):
        done()


def test_a_silent_peer_is_dropped_at_the_handshake_deadline():
    server, client = _pair()
    began = time.monotonic()
    with pytest.raises(ProtocolError, match="in time"):
        _wire.server_handshake(server, SECRET, 0.3)
    assert time.monotonic() - began < 2
    client.close()


def test_a_frame_of_an_unexpected_kind_or_size_is_refused_before_its_payload_is_read():
    a, b = _pair()
    link = _wire.Link(a, "peer")
    b.sendall(_wire.FRAME.pack(b"EVIL", 0))
    with pytest.raises(ProtocolError, match=r"sent a b'EVIL' message where only \['JOIN'\] may come"):
        link.recv_frame({b"JOIN": 100}, timeout=5)
    b.sendall(_wire.FRAME.pack(b"JOIN", 1 << 40) + b"x" * 10)
    with pytest.raises(ProtocolError, match="JOIN message of 1099511627776 bytes, at most 100"):
        link.recv_frame({b"JOIN": 100}, timeout=5)
    assert a.recv(10) == b"x" * 10, "the payload of a refused frame was read"
    b.sendall(_wire.FRAME.pack(b"JOIN", 5) + b"{oops")
    with pytest.raises(ProtocolError, match="not JSON"):
        link.recv_json({b"JOIN": 100}, timeout=5)


def test_a_frame_cut_short_is_an_end_of_link_not_a_hang():
    a, b = _pair()
    b.sendall(_wire.FRAME.pack(b"JOIN", 10) + b"abc")
    b.close()
    link = _wire.Link(a, "peer")
    assert link.recv_frame({b"JOIN": 100}, timeout=5) == (b"JOIN", 10)
    with pytest.raises(EOFError):
        link.recv_bytes(10, timeout=5)


def test_the_secret_comes_from_an_argument_the_environment_or_a_private_file(tmp_path, monkeypatch):
    monkeypatch.delenv(_wire.SECRET_ENV, raising=False)
    monkeypatch.delenv(_wire.SECRET_FILE_ENV, raising=False)
    with pytest.raises(ValueError, match="no relay secret"):
        _wire.resolve_secret()
    generated, made = _wire.resolve_secret(generate=True)
    assert made and len(generated) >= 32
    with pytest.raises(ValueError, match="at least 16 bytes"):
        _wire.resolve_secret("short")
    monkeypatch.setenv(_wire.SECRET_ENV, "from the environment, long")
    assert _wire.resolve_secret() == (b"from the environment, long", False)
    monkeypatch.delenv(_wire.SECRET_ENV)
    path = tmp_path / "secret"
    path.write_text("from a file, long enough\n")
    monkeypatch.setenv(_wire.SECRET_FILE_ENV, str(path))
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="only you can read"):
        _wire.resolve_secret()
    os.chmod(path, 0o600)
    assert _wire.resolve_secret() == (b"from a file, long enough", False)


@pytest.mark.parametrize(
    "value", [None, ["host"], ["h", 0], ["h", 70000], ["h", True], ["", 1], ["a b", 1], ["x" * 300, 1], "h:1"]
)
def test_an_address_a_peer_sends_is_checked(value):
    with pytest.raises(ProtocolError, match=r"want \[host, port\]"):
        _wire.address(value, "an address")
    assert _wire.address(["10.0.0.2", 29600], "an address") == ("10.0.0.2", 29600)
