"""Where everything lives inside a segment: the header words and the tensor layout.

A segment is::

    [ header: 48 KiB of int64 words ][ layout (JSON) ][ slot 0 ][ slot 1 ] ... [ slot N-1 ]

Every slot holds one full copy of the weights: each tensor at a 64-byte aligned
offset, in the order of :attr:`Layout.entries`. Keys are tuples (nested
TensorDict keys); the first element is the destination when a store holds several.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch
from tensordict import TensorDict, TensorDictBase
from torch.nn.parameter import is_lazy

from ._header import ALIGN, HEADER_BYTES, PAGE
from .errors import WeightMismatchError


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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_leaf(cls: type) -> bool:
    return not issubclass(cls, TensorDictBase) or getattr(cls, "_is_non_tensor", False)


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
    """The keys, shapes, dtypes and offsets of the tensors in one slot."""

    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries
        self.index = {e.key: i for i, e in enumerate(entries)}
        last = entries[-1] if entries else None
        self.payload_bytes = (last.offset + last.nbytes) if last else 0
        self.slot_bytes = _align(max(self.payload_bytes, 1), PAGE)

    @classmethod
    def from_tensordict(cls, td: TensorDictBase) -> Layout:
        entries, offset = [], 0
        for key, t in _leaves(td):
            nbytes = t.numel() * t.element_size()
            entries.append(Entry(key, tuple(t.shape), t.dtype, offset, nbytes))
            offset = _align(offset + nbytes, ALIGN)
        if not entries:
            raise WeightMismatchError("nothing to store: the source has no parameters or buffers")
        return cls(entries)

    def to_json(self, destinations: tuple[str, ...] | None) -> bytes:
        rows = [[list(e.key), list(e.shape), _dtype_name(e.dtype), e.offset, e.nbytes] for e in self.entries]
        doc = {"destinations": list(destinations) if destinations else None, "entries": rows}
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> tuple[Layout, tuple[str, ...] | None]:
        doc = json.loads(raw.decode())
        entries = [Entry(tuple(k), tuple(s), getattr(torch, d), o, n) for k, s, d, o, n in doc["entries"]]
        dests = doc["destinations"]
        return cls(entries), (tuple(dests) if dests else None)

    def subset(self, prefix: tuple[str, ...]) -> list[int]:
        """Indices of the entries under ``prefix`` (all entries for an empty prefix)."""
        n = len(prefix)
        return [i for i, e in enumerate(self.entries) if e.key[:n] == prefix]

    def match(
        self, td: TensorDictBase, what: str = "weights", prefix: tuple[str, ...] = (), allow_meta: bool = False
    ) -> list[torch.Tensor]:
        """Tensors of ``td`` in entry order, after checking keys, shapes and dtypes.

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
            got = {k for k, _ in leaves}
            missing = sorted(key_str(k) for k in want - got)
            extra = sorted(key_str(k) for k in got - want)
            raise WeightMismatchError(
                f"{what} do not have the store's keys: missing {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}"
            )
        tensors = []
        for (key, t), e in zip(leaves, entries):
            if tuple(t.shape) != e.shape:
                raise WeightMismatchError(
                    f"{what}: {key_str(key)!r} has shape {tuple(t.shape)}, the store holds {e.shape}"
                )
            if t.dtype != e.dtype:
                raise WeightMismatchError(f"{what}: {key_str(key)!r} has dtype {t.dtype}, the store holds {e.dtype}")
            if t.is_meta and not allow_meta:
                raise WeightMismatchError(f"{what}: {key_str(key)!r} is on the meta device and holds no data")
            tensors.append(t)
        return tensors

    def slot_views(self, buf, slot_offset: int) -> list[torch.Tensor]:
        """Tensors viewing one slot of a mapping, in entry order."""
        views = []
        for e in self.entries:
            if e.nbytes == 0:
                views.append(torch.empty(e.shape, dtype=e.dtype))
                continue
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=e.nbytes, offset=slot_offset + e.offset)
            views.append(raw.view(e.dtype).view(e.shape) if e.shape else raw.view(e.dtype).reshape(()))
        return views

    def as_tensordict(self, tensors: list[torch.Tensor]) -> TensorDict:
        td = TensorDict()
        for e, t in zip(self.entries, tensors):
            td.set(e.key if len(e.key) > 1 else e.key[0], t)
        return td


def segment_bytes(layout_json: bytes, slot_bytes: int, num_slots: int) -> tuple[int, int, int]:
    """(layout offset, data offset, total size) for a new segment."""
    data_offset = _align(HEADER_BYTES + len(layout_json), PAGE)
    return HEADER_BYTES, data_offset, data_offset + slot_bytes * num_slots


__all__ = ["Entry", "Layout", "segment_bytes"]
