"""Where everything lives inside a segment: the header words and the tensor layout.

A segment is::

    [ header: 136 KiB of int64 words ][ layout (JSON) ][ records ][ slot 0 ][ slot 1 ] ... [ slot N-1 ]

The records (from the first page after the layout) hold, per slot and tensor, the version the
tensor last changed at as of the version the slot holds (see :mod:`shmsync.core.header`); the
slots start at the first page after them.

Every slot holds one full copy of the weights: each tensor at a 64-byte aligned
offset, in the order of :attr:`Layout.entries`. Keys are tuples (nested
TensorDict keys); the first element is the destination when a store holds several. Tensors that
are one tensor of the source under two keys (tied weights: an embedding shared with an output
layer) are held once: the later key's entry is *tied* to the first's, at its offset, and holds no
bytes of its own (a publish copies it once, a reader in place views the same memory for both).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tensordict
import torch
from tensordict import TensorDict, TensorDictBase
from torch.nn.parameter import is_lazy

from shmsync.core.header import ALIGN, HEADER_BYTES, MAX_LAYOUT_BYTES, MAX_LEAVES, PAGE, RECORD_BYTES
from shmsync.errors import StoreCorruptError, WeightMismatchError

# Every dtype torch has, by the name a layout stores: never getattr(torch, name) on a name read from a file.
DTYPES = {
    str(d).removeprefix("torch."): d for d in (getattr(torch, n) for n in dir(torch)) if isinstance(d, torch.dtype)
}
MAX_ENTRIES = MAX_LEAVES  # tensors a store holds: far more than any model has
MAX_PAYLOAD_BYTES = 1 << 40  # a slot: 1 TiB
MAX_RANK = 64
MAX_KEY_DEPTH = 32


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def key_str(key: tuple[str, ...]) -> str:
    return ".".join(key)


@dataclass(frozen=True)
class Entry:
    key: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # within a slot
    nbytes: int
    tied: int = -1  # the entry whose bytes it shares (an earlier one), or -1: bytes of its own


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# tensordict's non-tensor containers (the public classes each tensordict minor has).
_NON_TENSOR = tuple(
    c for c in (getattr(tensordict, n, None) for n in ("NonTensorDataBase", "NonTensorStack")) if isinstance(c, type)
)


def _is_leaf(cls: type) -> bool:
    return not issubclass(cls, TensorDictBase) or issubclass(cls, _NON_TENSOR)


def _leaves(td: TensorDictBase) -> list[tuple[tuple[str, ...], torch.Tensor]]:
    out = []
    # Non-tensor entries count as leaves here so they are reported, not silently dropped.
    for key, value in td.items(include_nested=True, leaves_only=True, is_leaf=_is_leaf):
        key = (key,) if isinstance(key, str) else tuple(key)
        if not isinstance(value, torch.Tensor):
            raise WeightMismatchError(f"entry {key_str(key)!r} is a {type(value).__name__}, not a tensor")
        if is_lazy(value):
            raise WeightMismatchError(
                f"entry {key_str(key)!r} is an uninitialized parameter of a lazy module (its shape is not known "
                "yet): run one forward pass through the module, or give the layer its input size, first"
            )
        out.append((key, value))
    out.sort(key=lambda kv: kv[0])
    return out


class Layout:
    """The keys, shapes, dtypes and offsets of the tensors in one slot.

    Attributes:
        owners: the entries that hold bytes of their own (all but the tied ones), in order.
        tied: each tied entry's owner, by index (empty where nothing is tied).
    """

    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries
        self.index = {e.key: i for i, e in enumerate(entries)}
        self.owners = [i for i, e in enumerate(entries) if e.tied < 0]
        self.tied = {i: e.tied for i, e in enumerate(entries) if e.tied >= 0}
        last = entries[self.owners[-1]] if self.owners else None
        self.payload_bytes = (last.offset + last.nbytes) if last else 0
        self.slot_bytes = _align(max(self.payload_bytes, 1), PAGE)

    @classmethod
    def from_tensordict(cls, td: TensorDictBase) -> Layout:
        entries: list[Entry] = []
        offset = 0
        seen: dict[tuple, int] = {}  # one tensor's memory, shape and dtype -> its first entry
        for key, t in _leaves(td):
            nbytes = t.numel() * t.element_size()
            same = (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) if nbytes and not t.is_meta else None
            owner = seen.get(same, -1) if same is not None else -1
            if owner >= 0:  # the tensor of an earlier key: tied to it
                entries.append(Entry(key, tuple(t.shape), t.dtype, entries[owner].offset, nbytes, owner))
                continue
            if same is not None:
                seen[same] = len(entries)
            entries.append(Entry(key, tuple(t.shape), t.dtype, offset, nbytes))
            offset = _align(offset + nbytes, ALIGN)
        if not entries:
            raise WeightMismatchError("nothing to store: the source has no parameters or buffers")
        return cls(entries)

    def to_json(self, destinations: tuple[str, ...] | None) -> bytes:
        rows = [[list(e.key), list(e.shape), _dtype_name(e.dtype), e.offset, e.nbytes, e.tied] for e in self.entries]
        doc = {"destinations": list(destinations) if destinations else None, "entries": rows}
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes, what: str = "layout") -> tuple[Layout, tuple[str, ...] | None]:
        """Parse a layout description (:meth:`to_json`'s bytes, from a store file or a peer),
        checking every field before anything is sized from it.

        Raises:
            StoreCorruptError: naming ``what``, the first field out of range and its value.
        """
        return parse_description(raw, what)

    def subset(self, prefix: tuple[str, ...]) -> list[int]:
        """Indices of the entries under ``prefix`` (all entries for an empty prefix)."""
        n = len(prefix)
        return [i for i, e in enumerate(self.entries) if e.key[:n] == prefix]

    def match(
        self, td: TensorDictBase, what: str = "weights", prefix: tuple[str, ...] = (), allow_meta: bool = False
    ) -> list[torch.Tensor]:
        """Tensors of ``td`` in entry order, after checking keys, shapes and dtypes (a publish
        also checks that tied entries are still one tensor: :meth:`check_tied`).

        Args:
            td: the weights to check.
            what: how error messages name ``td``.
            prefix: match only the entries under this key prefix (a destination), with the
                prefix stripped from their keys.
            allow_meta: accept tensors on the meta device (targets about to be materialized).

        Raises:
            WeightMismatchError: naming the first key, shape or dtype that differs.
        """
        n = len(prefix)
        entries = [self.entries[i] for i in self.subset(prefix)]
        want = {e.key[n:] for e in entries}
        leaves = _leaves(td)
        if len(leaves) != len(entries) or any(k not in want for k, _ in leaves):
            raise WeightMismatchError(f"{what} do not have the store's keys: {_key_difference(want, leaves)}")
        tensors = []
        for (key, t), e in zip(leaves, entries):
            _check_tensor(what, key, t, e, allow_meta)
            tensors.append(t)
        return tensors

    def slot_views(self, buf, slot_offset: int) -> list[torch.Tensor]:
        """Tensors viewing one slot of a mapping, in entry order (a tied entry: its owner's view)."""
        views: list[torch.Tensor] = []
        for e in self.entries:
            if e.tied >= 0:
                views.append(views[e.tied])
                continue
            if e.nbytes == 0:
                views.append(torch.empty(e.shape, dtype=e.dtype))
                continue
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=e.nbytes, offset=slot_offset + e.offset)
            views.append(raw.view(e.dtype).view(e.shape) if e.shape else raw.view(e.dtype).reshape(()))
        return views

    def check_tied(self, tensors: list[torch.Tensor], what: str) -> None:
        """Raise unless each tied entry's tensor is its owner's (one memory, one shape and strides):
        a store holds tied weights once, so weights that came apart cannot be published into it.

        Raises:
            WeightMismatchError: naming the two keys.
        """
        for i, owner in self.tied.items():
            t, o = tensors[i], tensors[owner]
            if t is not o and (t.data_ptr(), t.stride(), t.device) != (o.data_ptr(), o.stride(), o.device):
                tied, to = key_str(self.entries[i].key), key_str(self.entries[owner].key)
                raise WeightMismatchError(
                    f"{what}: {tied!r} was one tensor with {to!r} (tied) when the store was made, and holds weights "
                    "of its own now; the store holds them once, so make a store of these weights "
                    "(WeightStore.create), or tie them again"
                )

    def as_tensordict(self, tensors: list[torch.Tensor]) -> TensorDict:
        td = TensorDict()
        for e, t in zip(self.entries, tensors):
            td.set(e.key if len(e.key) > 1 else e.key[0], t)
        return td


def _key_difference(want: set[tuple[str, ...]], leaves: list) -> str:
    """``'a.b', 'c' missing; 'd' not in the store``: the keys that differ, five of each at most."""
    got = {k for k, _ in leaves}
    parts = []
    for keys, says in ((want - got, "missing"), (got - want, "not in the store")):
        if keys:
            names = sorted(key_str(k) for k in keys)
            shown = ", ".join(repr(k) for k in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            parts.append(f"{shown} {says}")
    return "; ".join(parts) + _prefix_hint(want, got)


def _prefix_hint(want: set[tuple[str, ...]], got: set[tuple[str, ...]]) -> str:
    """What to pass instead, when every key differs from the store's by the same leading parts
    alone: another module's weights than the one the store was made from (a policy's inner
    network, ``net.`` where the store holds ``module.0.``), or a module wrapping it."""
    if len(want) != len(got) or not want:
        return ""
    rests = [{k[cut:] for k in got} for cut in range(len(_common_start(got)) + 1)]
    for cut_want in range(len(_common_start(want)) + 1):
        rest = {k[cut_want:] for k in want}
        cut_got = next((cut for cut, theirs in enumerate(rests) if (cut or cut_want) and theirs == rest), None)
        if cut_got is not None:
            ours, theirs = (".".join(next(iter(keys))[:cut]) for keys, cut in ((want, cut_want), (got, cut_got)))
            if not theirs:
                change = f"without its leading {ours + '.'!r}"
            elif not ours:
                change = f"under an extra {theirs + '.'!r}"
            else:
                change = f"with {theirs + '.'!r} in place of {ours + '.'!r}"
            return (
                f". Only a prefix differs: each key here is one of the store's {change}. The store expects the keys "
                "of the object it was created from (a collector's: its policy), and these are another object's (a "
                "module inside it, or one around it): publish that object, or its state_dict()"
            )
    return ""


def _common_start(keys: set[tuple[str, ...]]) -> tuple[str, ...]:
    """The leading parts every key of ``keys`` shares, short of any whole key."""
    first = min(keys, key=len) if keys else ()
    n = 0
    while n < len(first) - 1 and all(k[n] == first[n] for k in keys):
        n += 1
    return first[:n]


def _check_tensor(what: str, key: tuple[str, ...], t: torch.Tensor, e: Entry, allow_meta: bool) -> None:
    if tuple(t.shape) != e.shape:
        raise WeightMismatchError(f"{what}: {key_str(key)!r} has shape {tuple(t.shape)}, the store holds {e.shape}")
    if t.dtype != e.dtype:
        raise WeightMismatchError(f"{what}: {key_str(key)!r} has dtype {t.dtype}, the store holds {e.dtype}")
    if t.is_meta and not allow_meta:
        raise WeightMismatchError(f"{what}: {key_str(key)!r} is on the meta device and holds no data")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_description(raw: bytes, what: str = "layout") -> tuple[Layout, tuple[str, ...] | None]:
    """See :meth:`Layout.from_json`."""

    def bad(problem: str) -> StoreCorruptError:
        return StoreCorruptError(f"{what}: {problem}")

    doc = _load_document(raw, bad)
    dests, rows = doc["destinations"], doc["entries"]
    _check_destinations(dests, bad)
    if not isinstance(rows, list) or not 1 <= len(rows) <= MAX_ENTRIES:
        count = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise bad(f"'entries' must be a list of 1 to {MAX_ENTRIES} tensors, got {count}")
    entries: list[Entry] = []
    for i, row in enumerate(rows):
        entries.append(_parse_entry(i, row, dests, entries, bad))
    return Layout(entries), (tuple(dests) if dests is not None else None)


def _load_document(raw: bytes, bad: Callable[[str], StoreCorruptError]) -> dict:
    """The layout's JSON object, its size and its number of lists checked before it is parsed."""
    if not isinstance(raw, (bytes, bytearray)) or not 1 <= len(raw) <= MAX_LAYOUT_BYTES:
        raise bad(f"{len(raw)} bytes; a layout is 1 to {MAX_LAYOUT_BYTES} bytes of JSON")
    # Parsing costs what the document holds, not what it is: each entry has three lists, so more
    # than that is refused before a list is made (30 MiB of "[]," would be 10 million of them).
    lists = bytes(raw).count(b"[")
    if lists > 3 * MAX_ENTRIES + 2:
        raise bad(f"{lists} lists; a layout of at most {MAX_ENTRIES} tensors holds at most {3 * MAX_ENTRIES + 2}")
    try:
        doc = json.loads(bytes(raw).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise bad(f"not valid JSON ({type(e).__name__}: {str(e)[:100]})") from None
    if not isinstance(doc, dict) or set(doc) != {"destinations", "entries"}:
        keys = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
        raise bad(f"want an object with 'destinations' and 'entries', got {keys}")
    return doc


def _check_destinations(dests: Any, bad: Callable[[str], StoreCorruptError]) -> None:
    if dests is not None and (
        not isinstance(dests, list)
        or not dests
        or not all(isinstance(d, str) and 0 < len(d) <= 1000 for d in dests)
        or len(set(dests)) != len(dests)
    ):
        raise bad(f"'destinations' must be null or a list of distinct non-empty names, got {str(dests)[:200]}")


def _parse_key(i: int, key: Any, dests: Any, previous: Entry | None, bad: Callable) -> tuple[str, ...]:
    if (
        not isinstance(key, list)
        or not 1 <= len(key) <= MAX_KEY_DEPTH
        or not all(isinstance(k, str) and 0 < len(k) <= 1000 for k in key)
    ):
        raise bad(f"entry {i}: key must be a list of 1 to {MAX_KEY_DEPTH} non-empty names, got {str(key)[:200]}")
    key = tuple(key)
    if previous is not None and key <= previous.key:
        raise bad(f"entry {i}: key {key_str(key)!r} is out of order or repeated (keys are sorted)")
    if dests is not None and key[0] not in dests:
        raise bad(f"entry {i}: key {key_str(key)!r} is under no destination of {dests}")
    return key


def _parse_shape_and_dtype(where: str, shape: Any, dtype: Any, bad: Callable) -> tuple[torch.dtype, int]:
    """The dtype and the number of elements of an entry's shape and dtype, checked."""
    if not isinstance(shape, list) or len(shape) > MAX_RANK or not all(_is_int(d) and d >= 0 for d in shape):
        raise bad(f"{where}: shape must be up to {MAX_RANK} sizes >= 0, got {str(shape)[:200]}")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise bad(f"{where}: unknown dtype {str(dtype)[:100]!r}")
    numel = 1
    for d in shape:
        numel *= d
    return DTYPES[dtype], numel


def _parse_entry(i: int, row: Any, dests: Any, entries: list[Entry], bad: Callable) -> Entry:
    """Entry ``i`` of a layout, each field checked: in key order, placed right after the last
    entry with bytes of its own, or tied to an earlier one (its shape, dtype and offset)."""
    if not isinstance(row, list) or len(row) != 6:
        raise bad(f"entry {i} must be [key, shape, dtype, offset, nbytes, tied], got {str(row)[:200]}")
    key, shape, dtype, offset, nbytes, tied = row
    previous = entries[-1] if entries else None
    key = _parse_key(i, key, dests, previous, bad)
    where = f"entry {i} ({key_str(key)!r})"
    dt, numel = _parse_shape_and_dtype(where, shape, dtype, bad)
    if not _is_int(nbytes) or nbytes != numel * dt.itemsize:
        raise bad(f"{where}: nbytes is {nbytes}, shape {shape} of {dtype} takes {numel * dt.itemsize}")
    if not _is_int(tied) or not -1 <= tied < i:
        raise bad(f"{where}: tied is {str(tied)[:20]}; it is -1, or the index of an earlier entry")
    if tied >= 0:
        return _tied_entry(where, Entry(key, tuple(shape), dt, offset, nbytes, tied), entries[tied], bad)
    last = next((e for e in reversed(entries) if e.tied < 0), None)
    want = _align(last.offset + last.nbytes if last is not None else 0, ALIGN)
    if not _is_int(offset) or offset != want:
        raise bad(f"{where}: offset is {offset}, the next {ALIGN}-byte boundary is {want}")
    if offset + nbytes > MAX_PAYLOAD_BYTES:
        raise bad(f"{where} ends at byte {offset + nbytes}, past {MAX_PAYLOAD_BYTES} (1 TiB)")
    return Entry(key, tuple(shape), dt, offset, nbytes)


def _tied_entry(where: str, entry: Entry, owner: Entry, bad: Callable) -> Entry:
    """``entry``, tied to ``owner``, checked: one shape, dtype and offset, bytes to share."""
    if owner.tied >= 0 or (owner.shape, owner.dtype, owner.offset) != (entry.shape, entry.dtype, entry.offset):
        raise bad(f"{where}: tied to entry {entry.tied}, which it does not match (shape, dtype, offset)")
    if not entry.nbytes:
        raise bad(f"{where}: tied to entry {entry.tied}, but holds no bytes to share")
    return entry


def segment_bytes(layout_json: bytes, slot_bytes: int, num_slots: int, entries: int) -> tuple[int, int, int, int]:
    """(layout offset, records offset, data offset, total size) for a new segment of ``num_slots``
    slots of ``slot_bytes``, whose layout has ``entries`` tensors."""
    records_offset = _align(HEADER_BYTES + len(layout_json), PAGE)
    data_offset = _align(records_offset + num_slots * entries * RECORD_BYTES, PAGE)
    return HEADER_BYTES, records_offset, data_offset, data_offset + slot_bytes * num_slots


__all__ = ["Entry", "Layout", "segment_bytes"]
