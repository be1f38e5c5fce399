"""What each push of shmsync's distributed collectors sends each node: the leaves of the trainer's
weights that changed since the version the node holds; the whole weights to a node that holds no
version the trainer knows (one that missed the weights at the start, or whose last push failed).

TorchRL's ``DistributedWeightSyncScheme`` pushes the trainer's weights as a TensorDict
(``TensorDict.send``: one torch.distributed message per leaf, in sorted key order) and each node
receives into a buffer of the same keys (``TensorDict.recv``), leaf for leaf. shmsync's collectors
wrap both ends of each transport (:mod:`shmsync.torchrl.compat`, ``DIST_LEAVES``), and leave the
transport itself to TorchRL:

- **the trainer**, once per push, finds which leaves changed since the last push as a store's writer
  does (:class:`~shmsync.writer.changes.SourceChanges`: the pages the kernel says were written, or a
  comparison with a copy of the last push's weights, which the trainer keeps), and notes the push
  each leaf last changed at. Each node it pushes to is sent a TensorDict of the leaves that changed
  since the version that node holds, the list of them written first into the push's TCPStore
  (:data:`LEAVES_KEY`: the push, the version it is from, the leaves, and a digest of the key names);
- **the node** reads the list, checks it (every index in range and in order, the leaves its own
  buffer's, the version it is from the one its buffer holds), and receives into those leaves of its
  buffer, which then holds the push's weights whole: the others hold the bytes of the version it is
  from, which the trainer proved unchanged since. Its collector publishes the buffer into the node's
  store, which copies what changed. A list it refuses is answered to the trainer (the push fails,
  naming it) and nothing of that push is published.

The trainer keeps one copy of the weights it last pushed (where the kernel cannot tell it which
pages were written, it compares with it): the memory of one slot of a store.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from typing import Any

import torch

from shmsync.errors import ShmSyncError
from shmsync.store.copies import copy_all
from shmsync.store.reader_table import Transfer
from shmsync.torchrl import compat
from shmsync.writer.changes import SourceChanges

LEAVES_KEY = "shmsync/leaves/{rank}"  # the leaves the trainer sends a node at this push
UNREADABLE = -1  # refused: a list that could not be read (whichever push it was)
MAX_LIST_BYTES = 4 << 20  # a list is at most this long (a million leaves)


def leaf_keys(weights: Any) -> list[tuple[str, ...]]:
    """The tensor leaves of ``weights`` (a TensorDict), as tuples, in the order both ends count them."""
    keys = weights.keys(include_nested=True, leaves_only=True)
    return sorted(k if isinstance(k, tuple) else (k,) for k in keys)


def _names_digest(keys: list[tuple[str, ...]]) -> str:
    return hashlib.sha256(json.dumps(keys).encode()).hexdigest()[:32]


def _nbytes(weights: Any, keys: list[tuple[str, ...]]) -> int:
    return sum(t.numel() * t.element_size() for t in (weights.get(k) for k in keys))


class TrainerLeaves:
    """The trainer's side, for one distributed push scheme: which leaves each push sends each node.

    Args:
        store: the TCPStore the scheme pushes through (the lists go there).
    """

    def __init__(self, store: torch.distributed.Store) -> None:
        self.store = store
        self.push = 0  # the push under way (the trainer's number of it)
        self.buffer_versions: dict[int, int] = {}  # rank -> the version its buffer holds, as confirmed
        self.sent: dict[int, Transfer] = {}  # rank -> what the pushes to it cost
        self._keys: list[tuple[str, ...]] | None = None
        self._changes: SourceChanges | None = None
        self._reference: list[torch.Tensor] | None = None  # the last push's weights
        self._found_at = -1  # the push the changes were last found at

    def install(self, scheme: Any) -> None:
        """Wrap the send of each of ``scheme``'s transports (before the nodes start)."""
        for rank, transport in compat.sender_transports(scheme).items():
            compat.wrap_on_instance(transport, "send_initial_weights", self._initial_sender(rank), compat.DIST_LEAVES)
            compat.wrap_on_instance(transport, "send_weights_async", self._push_sender(rank), compat.DIST_LEAVES)

    def begin(self, push: int) -> None:
        """A push numbered ``push`` is about to be sent."""
        self.push = push

    def confirmed(self, rank: int, push: int, ok: bool) -> None:
        """Node ``rank`` answered push ``push``: it holds that version (``ok``), or nothing known."""
        if ok:
            self.buffer_versions[rank] = push
        else:
            self.buffer_versions.pop(rank, None)

    def _initial_sender(self, rank: int) -> Callable[[Callable], Callable]:
        def wrap(original: Callable) -> Callable:
            def send_initial_weights(weights: Any) -> Any:
                result = original(weights)
                if _is_tensordict(weights):
                    self._find(weights, 0)
                    self.buffer_versions[rank] = 0  # the weights every node starts from: version 0
                return result

            return send_initial_weights

        return wrap

    def _push_sender(self, rank: int) -> Callable[[Callable], Callable]:
        def wrap(original: Callable) -> Callable:
            def send_weights_async(weights: Any) -> Any:
                if not _is_tensordict(weights):
                    return original(weights)
                keys = self._find(weights, self.push)
                leaves = self._leaves_for(rank)
                base = self.buffer_versions.get(rank, -1) if leaves is not None else -1
                doc = {"push": self.push, "base": base, "leaves": leaves, "names": _names_digest(keys)}
                self.store.set(LEAVES_KEY.format(rank=rank), json.dumps(doc, separators=(",", ":")))
                sent = keys if leaves is None else [keys[i] for i in leaves]
                self._count(rank, _nbytes(weights, sent), leaves is not None)
                return original(weights if leaves is None else weights.select(*sent))

            return send_weights_async

        return wrap

    def _count(self, rank: int, nbytes: int, delta: bool) -> None:
        t = self.sent.get(rank) or Transfer(-1, 0, False, 0, 0, 0)
        self.sent[rank] = Transfer(
            self.push, nbytes, delta, t.deltas + delta, t.wholes + (not delta), t.total_bytes + nbytes
        )

    def _find(self, weights: Any, push: int) -> list[tuple[str, ...]]:
        """Once per push: which leaves changed since the last push (noted in the changes' ``changed_at``)."""
        keys = leaf_keys(weights)
        if keys != self._keys:  # other weights: nothing known of them
            self._keys, self._changes, self._reference, self._found_at = keys, SourceChanges(len(keys)), None, -1
            self.buffer_versions.clear()
        if self._found_at == push:
            return keys
        changes = self._changes
        assert changes is not None
        tensors = [weights.get(k).detach() for k in keys]
        if self._reference is None:
            found = changes.find(tensors, None, "push")  # every leaf, first seen now
            self._reference = [t.clone() for t in tensors]
        else:
            found = changes.find(tensors, self._reference, "push")
            changed = [i for i, f in enumerate(found) if f]
            if changed:
                copy_all([self._reference[i] for i in changed], [tensors[i] for i in changed])
        changes.published(push, self._found_at, found)
        self._found_at = push
        return keys

    def _leaves_for(self, rank: int) -> list[int] | None:
        """The leaves that changed since the version node ``rank`` holds; None: all of them (it
        holds none known, or every leaf changed)."""
        base, changes = self.buffer_versions.get(rank, -1), self._changes
        if base < 0 or changes is None:
            return None
        at = changes.changed_at
        leaves = [i for i, a in enumerate(at) if not 0 <= a <= base]
        return None if len(leaves) == len(at) else leaves


def _is_tensordict(weights: Any) -> bool:
    from tensordict import TensorDictBase

    return isinstance(weights, TensorDictBase)


# -- the node's side -----------------------------------------------------------------------------------
class NodeLeaves:
    """A node's receiving transport, wrapped: each push received into the leaves its list names.

    Args:
        store: the push's TCPStore; rank: this node's; buffer: the transport's receive buffer.
    """

    def __init__(self, store: torch.distributed.Store, rank: int, buffer: Any) -> None:
        self.store, self.rank, self.buffer = store, rank, buffer
        self.buffer_version = -1  # the version its buffer holds whole (-1: none known)
        self.refused: dict[int, str] = {}  # push -> why its list was refused
        self.transfer: Transfer | None = None

    def wrap_initial(self, original: Callable) -> Callable:
        def receive_initial_weights(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            self.buffer_version = 0
            return result

        return receive_initial_weights

    def wrap_receive(self, original: Callable) -> Callable:
        def receive_weights(
            timeout: float | None = None, *, weights: Any = None, model: Any = None, strategy: Any = None
        ) -> Any:
            buffer = weights if weights is not None else self.buffer
            keys = leaf_keys(buffer)
            try:
                push, base, leaves = self._take_list(keys)
            except ShmSyncError as e:
                # Never raised into TorchRL's receive (it would never acknowledge the push): this
                # node cannot tell what the trainer sends, so it receives nothing, and its
                # collector refuses the push (see refusal()): the trainer's push fails naming it.
                self.refused[UNREADABLE] = str(e)
                self.buffer_version = -1
                return buffer
            part = buffer if leaves is None else buffer.select(*[keys[i] for i in leaves])
            received = original(timeout, weights=part, model=None, strategy=None)
            if received is None:  # timed out: nothing whole arrived
                self.buffer_version = -1
                return None
            if model is not None and strategy is not None:
                strategy.apply_weights(model, part)
            refused = push is not None and push in self.refused
            self.buffer_version = push if push is not None and not refused else -1
            sent = keys if leaves is None else [keys[i] for i in leaves]
            self._count(push, _nbytes(buffer, sent), leaves is not None)
            return buffer

        return receive_weights

    def _take_list(self, keys: list[tuple[str, ...]]) -> tuple[int | None, int, list[int] | None]:
        """The list of the push being received, checked: ``(push, base, leaves)``, leaves None for
        the whole weights (and for a push with no list: one that went around shmsync's wrappers).
        A list that names leaves this buffer has, from another version than the one it holds, is
        received (the trainer sends those leaves) and its push refused."""
        key = LEAVES_KEY.format(rank=self.rank)
        if not self.store.check([key]):
            return None, -1, None
        raw = self.store.get(key)
        self.store.delete_key(key)
        doc = parse_list(raw, keys)
        push, base, leaves = doc
        if leaves is not None and base != self.buffer_version:
            have = (
                f"holds version {self.buffer_version}"
                if self.buffer_version >= 0
                else "holds no version the trainer sent whole"
            )
            self.refused[push] = (
                f"push {push} sent node {self.rank} the leaves changed since version {base}, but its buffer {have}"
            )
        return doc

    def take_refusal(self, push: int) -> str | None:
        """Why push ``push``'s list was refused, or a list that could not be read (None: neither),
        forgotten once told."""
        return self.refused.pop(push, None) or self.refused.pop(UNREADABLE, None)

    def _count(self, push: int | None, nbytes: int, delta: bool) -> None:
        t = self.transfer or Transfer(-1, 0, False, 0, 0, 0)
        version = push if push is not None else t.version
        self.transfer = Transfer(
            version, nbytes, delta, t.deltas + delta, t.wholes + (not delta), t.total_bytes + nbytes
        )


def parse_list(raw: Any, keys: list[tuple[str, ...]]) -> tuple[int, int, list[int] | None]:
    """A push's list of leaves as the node reads it: ``(push, base, leaves)``, every field checked
    against the node's buffer (``keys``).

    Raises:
        ShmSyncError: naming what is off; the node cannot tell what the trainer sends, so the push
            is refused (and the trainer's push fails naming it).

    Examples:
        >>> keys = [("head", "bias"), ("head", "weight"), ("trunk", "weight")]
        >>> doc = {"push": 5, "base": 4, "leaves": [0, 1], "names": _names_digest(keys)}
        >>> parse_list(json.dumps(doc).encode(), keys)
        (5, 4, [0, 1])
    """
    if not isinstance(raw, (bytes, str)) or len(raw) > MAX_LIST_BYTES:
        raise ShmSyncError(f"a push's leaf list is not text of at most {MAX_LIST_BYTES} bytes")
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise ShmSyncError(f"a push's leaf list is not JSON: {str(raw)[:60]}") from None
    if not isinstance(doc, dict) or set(doc) != {"push", "base", "leaves", "names"}:
        raise ShmSyncError(f"a push's leaf list is {str(doc)[:80]}, not {{push, base, leaves, names}}")
    push, base, leaves = doc["push"], doc["base"], doc["leaves"]
    if not (_is_int(push) and push >= 1 and _is_int(base) and -1 <= base < push):
        raise ShmSyncError(f"a push's leaf list names push {str(push)[:20]} from version {str(base)[:20]}")
    if doc["names"] != _names_digest(keys):
        raise ShmSyncError(f"push {push}'s leaf list is of other leaves than this node's {len(keys)} (another model)")
    return push, base, None if leaves is None else _checked_leaves(push, leaves, len(keys))


def _checked_leaves(push: int, leaves: Any, count: int) -> list[int]:
    """The leaf indices of push ``push``'s list, checked against a buffer of ``count`` leaves."""
    if not isinstance(leaves, list) or len(leaves) > count:
        raise ShmSyncError(f"push {push}'s leaf list is not a list of at most {count} leaves")
    last = -1
    for i in leaves:
        if not (_is_int(i) and last < i < count):
            why = "out of range" if _is_int(i) and not 0 <= i < count else "not in increasing order"
            raise ShmSyncError(
                f"push {push}'s leaf list names leaf {str(i)[:20]} after leaf {last}: {why} (this node's weights "
                f"have {count} leaves)"
            )
        last = i
    return list(leaves)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


_NODES: list[NodeLeaves] = []  # this process's receiving transports (a node runs one per pushed model)
_NODES_LOCK = threading.Lock()


class NodeTransports:
    """What the nodes' copies of a trainer's push scheme make their receiving transport with
    (set on the trainer's instance before it travels to them): TorchRL's, its receive wrapped by a
    :class:`NodeLeaves`. Picklable: it holds nothing."""

    def __call__(self, **kwargs: Any) -> Any:
        transport, store, rank, buffer = compat.node_transport(kwargs)
        node = NodeLeaves(store, rank, buffer)
        compat.wrap_on_instance(transport, "receive_initial_weights", node.wrap_initial, compat.DIST_LEAVES)
        compat.wrap_on_instance(transport, "receive_weights", node.wrap_receive, compat.DIST_LEAVES)
        with _NODES_LOCK:
            _NODES.append(node)
        return transport


def refusal(push: int) -> str | None:
    """Why this node refused push ``push``'s leaf list, or a list it could not read (None: neither);
    asked once per push, as the node's collector is told of it."""
    with _NODES_LOCK:
        nodes = list(_NODES)
    for node in nodes:
        why = node.take_refusal(push)
        if why is not None:
            return why
    return None


def node_transfer() -> Transfer | None:
    """What the pushes this node received cost (its first receiving transport's), for its report."""
    with _NODES_LOCK:
        return _NODES[0].transfer if _NODES else None


__all__ = ["LEAVES_KEY", "NodeLeaves", "NodeTransports", "TrainerLeaves", "leaf_keys", "parse_list"]
