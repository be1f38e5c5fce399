"""The relay's acceptor, driven one step at a time on real sockets: which handshake a flood cuts
when every place is taken decides whether a real relay gets in."""

import socket
import threading

import pytest

from shmsync.relay import wire
from shmsync.relay.acceptor import Acceptor

SECRET = b"thirty-two bytes or more of relay secret"


class Node:
    """What the acceptor needs of its relay server: a listening socket, the secret, and where to
    hand a peer that proved it."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.secret, self.encrypt, self.handshake_timeout = SECRET, True, 30.0
        self.stopping = threading.Event()
        self.refusals, self.admitted = [], []

    def refuse(self, why):
        self.refusals.append(why)

    def admit(self, sock, peer, keys):
        self.admitted.append(peer)
        sock.close()


@pytest.fixture
def node():
    node = Node()
    yield node
    node.sock.close()


def _connect(node, acceptor, source="127.0.0.1"):
    """A connection from ``source`` the acceptor has taken (the server's hello received): the
    socket and its entry."""
    sock = socket.create_connection(("127.0.0.1", node.port), timeout=5, source_address=(source, 0))
    before = set(acceptor.pending)
    acceptor._accept()
    assert sock.recv(wire.SERVER_HELLO, socket.MSG_WAITALL)[: len(wire.MAGIC)] == wire.MAGIC
    (fd,) = set(acceptor.pending) - before
    return sock, acceptor.pending[fd]


def test_a_flood_that_trickles_bytes_on_every_place_cuts_its_own_not_a_relays_fresh_handshake(node):
    acceptor = Acceptor(node)
    acceptor.most = 4
    flood = []
    for _ in range(4):  # every place taken by a connection that sent a byte and will never finish
        sock, pending = _connect(node, acceptor)
        sock.sendall(wire.MAGIC[:1])
        while not pending.got:
            acceptor._read(pending)
        flood.append((sock, pending))
    relay_sock, relay = _connect(node, acceptor)  # a relay's handshake, its hello not yet read
    _connect(node, acceptor)  # and the flood's next connection
    assert relay in acceptor.pending.values(), "the relay's handshake was cut for the flood's"
    # Each newcomer at capacity cut the flood's oldest, whatever it had sent.
    assert [p in acceptor.pending.values() for _, p in flood] == [False, False, True, True]
    assert len(node.refusals) == 2 and all("4 handshakes under way" in r for r in node.refusals), node.refusals
    # The relay's handshake goes on: it is admitted.
    theirs = relay.side.nonce
    ours = b"\1" * wire.NONCE_BYTES
    transcript = wire.MAGIC + theirs + ours + b"\1"
    relay_sock.sendall(wire.MAGIC + ours + b"\1" + wire._mac(SECRET, b"client", transcript))
    while relay in acceptor.pending.values():
        acceptor._read(relay)
    assert len(node.admitted) == 1
    assert relay_sock.recv(1) == bytes([wire.ACCEPTED])
    for sock, _ in flood:
        sock.close()
    relay_sock.close()


def test_at_capacity_the_source_with_the_most_handshakes_loses_its_oldest(node):
    acceptor = Acceptor(node)
    acceptor.most = 3
    lone = _connect(node, acceptor, source="127.0.0.2")  # the oldest, but its source has one
    busy = [_connect(node, acceptor, source="127.0.0.3") for _ in range(2)]
    newcomer = _connect(node, acceptor, source="127.0.0.3")
    assert lone[1] in acceptor.pending.values()
    assert busy[0][1] not in acceptor.pending.values() and busy[1][1] in acceptor.pending.values()
    assert newcomer[1] in acceptor.pending.values()
    for sock, _ in (lone, *busy, newcomer):
        sock.close()
