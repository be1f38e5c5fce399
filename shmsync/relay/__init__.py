"""Weights beyond one host: the trainer's store relayed over TCP to one relay process per host,
which publishes each version into that host's store under the trainer's version number.

The relays form a tree rooted at the trainer: the trainer's :class:`RelaySender` takes at most
``fanout`` relays itself and points every further one at a relay below it, so the trainer
sends each version ``fanout`` times however many hosts there are. A relay receives a version
straight into a free slot of its host's store and forwards each piece to the relays below it
as soon as it has arrived and passed its check (pipelined, not stored and forwarded); it
commits the version under the trainer's number once the last byte is in. A relay whose host
holds the version before a new one is sent only the leaves that changed
(:mod:`shmsync.relay.deltas`); one that holds any other gets the whole version. ``fanout=1`` makes a
chain, the default once a version spans 8 pieces
(:func:`~shmsync.relay.messages.choose_fanout`).

Every link starts with the handshake of :mod:`shmsync.relay.wire` (both ends prove the relay
secret), and its control frames are encrypted and authenticated under keys of that connection
alone. Each version is sealed once, by the trainer, under a key of that sealing alone
(:mod:`shmsync.relay.sealing`); relays forward its sealed pieces untouched and open each once,
into their host's store (``encrypt=False`` on both ends, only inside a tunnel, sends everything
plain). Each server binds only
the address it is given, runs every pending handshake on one thread with a deadline (a peer
silent for a second is cut), and points relays only at relays whose address it checked: the
relay there proved the secret and its identity. Every size and version a peer sends is checked
before a byte is received into memory or published. A peer that breaks the protocol is dropped
and logged (``logging.getLogger("shmsync.relay")``, refusals at most a few per 10 seconds);
nothing it sent is published.

Per host, latest wins: a link that is busy sending one version sends the newest one next and
skips those in between. A link idle for a while carries a keepalive; a relay that takes no bytes
for ``timeout`` seconds is dropped, freeing its place and its address. A slow relay delays only
the relays below it; a dead or stalled one cuts them off until they re-attach: each relay that
loses its parent goes back to the trainer, which points it at a relay with room, and continues
from the version its host holds. When the trainer closes its sender, every relay ends
(``run()`` returns); when the trainer dies, they raise :class:`~shmsync.errors.TrainerGoneError`.
"""

from __future__ import annotations

from shmsync.errors import TrainerGoneError
from shmsync.relay.messages import describe_difference
from shmsync.relay.node import Relay
from shmsync.relay.sender import RelaySender
from shmsync.relay.wire import read_secret_file

__all__ = ["Relay", "RelaySender", "TrainerGoneError", "describe_difference", "read_secret_file"]
