"""A trainer gone wrong, for the relay's side of the checks: a server that proves the secret and
then sends what its script says, and the pieces of the protocol a script sends."""

from __future__ import annotations

import os

from shmsync.relay import sealing, wire
from tests import processes
from tests.relay.peers import SECRET, SIZES, server_handshake
from tests.weights import blob_weights


class FakeTrainer:
    """A server that proves ``secret`` and then runs ``script(link, attempt)`` on each relay that
    connects: a trainer's sender gone wrong, for the relay's side of the checks."""

    def __init__(self, script, secret=SECRET):
        import socket as socket_module
        import threading

        self.script, self.secret = script, secret.encode()
        self.sock = socket_module.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.attempts = 0
        self.errors = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                sock, _ = self.sock.accept()
            except OSError:
                return
            self.attempts += 1
            try:
                keys = server_handshake(sock, self.secret, 5)
                link = wire.Link(sock, "relay", keys)
                _, self.joined = link.recv_json({b"JOIN": 4096}, 5)
                self.script(link, self.attempts)
            except Exception as e:  # the relay hung up on us: what we want
                self.errors.append(e)
            finally:
                sock.close()

    def close(self):
        self.sock.close()


def description(sizes=SIZES):
    from shmsync import WeightStore

    store = WeightStore.create(blob_weights(sizes, 0.0))
    try:
        return store.memory.layout_description, store.nbytes
    finally:
        store.close()


def admit(link, description, path=("0123456789abcdef",)):
    link.send(b"LYOT", description)
    link.send_json(b"CONF", {"fanout": 2, "path": list(path), "bucket": 1 << 24})
    return link.recv_json({b"HAVE": 4096, b"MISM": 4096}, 5)[1]


def send_version(link, version, nbytes, pieces):
    """A version as a trainer sends it: VERS, then ``pieces`` as DATA frames (on an encrypted link
    each sealed as :mod:`shmsync.relay.sealing` seals it, in pieces of the first one's size)."""
    import struct

    if link.keys is None:
        link.send(b"VERS", struct.pack(">qQ", version, nbytes))
        for piece in pieces:
            link.send(b"DATA", piece)
        return
    salt, size = os.urandom(sealing.SALT_BYTES), len(pieces[0]) if pieces and pieces[0] else nbytes
    aead = sealing._key(SECRET.encode(), salt, version, nbytes, size)
    frames = [aead.encrypt(sealing._nonce(i), p, sealing._aad(i)) if p else b"" for i, p in enumerate(pieces)]
    send_sealed(link, version, nbytes, size, salt, frames)


def relay_against(fake, host, timeout=3.0):
    """Run a relay for ``host`` against ``fake`` in this process: its error (or None), and a
    snapshot of its host's store before it closed (or None)."""
    from shmsync.relay import Relay

    processes.use_store_dir(host)
    relay = Relay("127.0.0.1", fake.port, store="policy", secret=SECRET, timeout=timeout, listen=None)
    error = snapshot = None
    try:
        relay.run()
    except Exception as e:
        error = e
    finally:
        if relay.store is not None:
            snapshot = relay.store.snapshot()
        relay.close()
        fake.close()
    return error, snapshot


def chain(error):
    out = []
    while error is not None:
        out.append(f"{type(error).__name__}: {error}")
        error = error.__cause__ or error.__context__
    return " <- ".join(out)


def sealed(version, payload, size, salt):
    """``payload`` sealed as the trainer seals a version: its pieces, as the wire carries them."""
    aead = sealing._key(SECRET.encode(), salt, version, len(payload), size)
    offsets = range(0, len(payload), size)
    return [aead.encrypt(sealing._nonce(i), payload[o : o + size], sealing._aad(i)) for i, o in enumerate(offsets)]


def send_sealed(link, version, nbytes, size, salt, frames):
    link.send(b"VERS", sealing.HEADER.pack(version, nbytes, size, salt))
    for frame in frames:
        link.send_or_keep(b"DATA", frame, sealed=True)


def send_delta(link, version, base, leaves, nbytes, payload, *, count=None, sealed_as=None):
    """A delta as a trainer sends it: DELT (the version header, then the base, the number of leaves
    and their indices), then ``payload`` in pieces (on an encrypted link sealed as
    :mod:`shmsync.relay.sealing` seals a delta: ``sealed_as`` gives another base and leaves to seal
    under). ``count`` overrides the number of leaves the header says."""
    import struct

    from shmsync.relay import deltas

    tail = deltas.DELTA.pack(base, len(leaves) if count is None else count) + struct.pack(f">{len(leaves)}I", *leaves)
    size = 1 << 20
    if link.keys is None:
        link.send(b"DELT", struct.pack(">qQ", version, nbytes) + tail)
        for offset in range(0, len(payload), size):
            link.send(b"DATA", payload[offset : offset + size])
        return
    salt = os.urandom(sealing.SALT_BYTES)
    seal_base, seal_leaves = sealed_as if sealed_as is not None else (base, leaves)
    aead = sealing._key(SECRET.encode(), salt, version, nbytes, size, seal_base, seal_leaves)
    link.send(b"DELT", sealing.HEADER.pack(version, nbytes, size, salt) + tail)
    for i, offset in enumerate(range(0, len(payload), size)):
        frame = aead.encrypt(sealing._nonce(i), payload[offset : offset + size], sealing._aad(i))
        link.send_or_keep(b"DATA", frame, sealed=True)
