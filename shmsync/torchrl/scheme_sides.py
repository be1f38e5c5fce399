"""The two sides of a :class:`~shmsync.ShmWeightSyncScheme`'s state, each with what crosses a pickle
named.

TorchRL builds a scheme once, in the trainer, and sends a copy of it to every worker (and, for a
remote collector, to every node or actor). A scheme's :class:`SenderSide` is what its trainer (or
node) holds: the stores, the route of every publish; a :class:`ReceiverSide` is what a worker's
copy needs to find its store, and the worker's receiver once set up. Each names in ``SENT`` the
fields a copy in another process gets; every other field starts afresh there.
"""

from __future__ import annotations

from typing import Any, TypeVar

from shmsync.store.reader_table import RemoteSources
from shmsync.torchrl.publisher import Publisher
from shmsync.torchrl.receiver import Receiver
from shmsync.torchrl.store_group import StoreGroup

_S = TypeVar("_S", bound="Side")


class Side:
    """What both sides share: ``SENT`` names the constructor's arguments a copy in another process
    gets (a pickle, or :meth:`sent`); every other field starts afresh there."""

    SENT: tuple[str, ...] = ()

    def sent(self: _S) -> _S:
        """A copy of what crosses a pickle (``SENT``), every other field afresh."""
        return type(self)(**self.__getstate__())

    def __getstate__(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.SENT}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]


class SenderSide(Side):
    """The trainer's side of a scheme (a node's, on a remote collector's node or actor).

    Args:
        remote_kind: ``"distributed"`` or ``"ray"`` where the scheme is the local scheme of one of
            shmsync's remote collectors: each node publishes the trainer's pushes under the
            trainer's numbers. None: a scheme of the trainer's own collector.
        upstream: on a node's scheme, where the trainer's push store listens.

    Attributes:
        group: the stores of the scheme's key (None until initialized on a sender).
        publisher: the route of every publish (None until the first publish or a collector).
        awaiting_collector: initialized before any collector, and none handed itself over yet.
        remote_rows: where a distributed or Ray collector's nodes report their workers.

    Examples:
        >>> import copy
        >>> side = SenderSide("ray")
        >>> side.awaiting_collector = True
        >>> sent = copy.copy(side)  # what a pickle carries: the remote kind and upstream only
        >>> sent.remote_kind, sent.awaiting_collector
        ('ray', False)
    """

    SENT = ("remote_kind", "upstream")

    def __init__(self, remote_kind: str | None = None, upstream: tuple[str, int] | None = None) -> None:
        self.remote_kind = remote_kind
        self.upstream = upstream
        self.group: StoreGroup | None = None
        self.publisher: Publisher | None = None
        self.awaiting_collector = False
        self.remote_rows = RemoteSources()


class ReceiverSide(Side):
    """What a worker's copy of a scheme needs from the trainer's, and the worker's receiver.

    Args:
        store_names: the stores to attach to (one, or one per worker with ``per_worker_weights``).
        expected_readers: readers that attach to each store in all (the last one unlinks its name).
        runs_sent_weights_next: the collector's next batch runs the weights an update sent: the
            worker waits at a rollout's start for a version the trainer promised.

    Attributes:
        receiver: the worker's :class:`~shmsync.torchrl.receiver.Receiver`, once set up (it never
            crosses a pickle).

    Examples:
        >>> import copy
        >>> side = ReceiverSide(["policy-store"], 2, True)
        >>> sent = copy.copy(side)
        >>> sent.store_names, sent.expected_readers, sent.runs_sent_weights_next, sent.receiver
        (['policy-store'], 2, True, None)
    """

    SENT = ("store_names", "expected_readers", "runs_sent_weights_next")

    def __init__(
        self,
        store_names: list[str] | None = None,
        expected_readers: int | None = None,
        runs_sent_weights_next: bool = False,
    ) -> None:
        self.store_names = list(store_names or [])
        self.expected_readers = expected_readers
        self.runs_sent_weights_next = runs_sent_weights_next
        self.receiver: Receiver | None = None
