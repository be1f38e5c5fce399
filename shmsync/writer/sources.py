"""What users pass as weights (a module, a TensorDict, a state dict, or a mapping of destinations
to any of those), in the one place that tells them apart: :func:`parts` splits a source by the
store's destinations, :func:`as_tensordict` turns one part into a TensorDict."""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from shmsync.errors import WeightMismatchError


def module_weights(module: nn.Module) -> TensorDictBase:
    """Parameters and buffers of ``module`` as a TensorDict (no copy)."""
    return TensorDict.from_module(module)


def as_tensordict(source: Any, what: str = "source") -> tuple[TensorDictBase, tuple[str, ...] | None]:
    """Returns ``(weights, destinations)``; destinations is None for a single module or TensorDict.

    A mapping ``{destination: module | TensorDict | state_dict}`` becomes one TensorDict keyed by
    destination, so that all destinations are published under one version.
    """
    if isinstance(source, nn.Module):
        return module_weights(source), None
    if isinstance(source, TensorDictBase):
        # A flat TensorDict keyed like a state dict ("0.weight") means nested keys.
        dotted = any("." in k for k in source.keys() if isinstance(k, str))  # flat: top-level keys
        return (source.unflatten_keys(".") if dotted else source), None
    if isinstance(source, Mapping):
        return _mapping_as_tensordict(source, what)
    raise TypeError(
        f"{what} must be an nn.Module, a TensorDict, or a mapping destination -> module/TensorDict; "
        f"got {type(source).__name__}"
    )


def _mapping_as_tensordict(source: Mapping, what: str) -> tuple[TensorDictBase, tuple[str, ...] | None]:
    """A state dict (``{"0.weight": tensor}``), or destinations (``{"policy": module, ...}``)."""
    if not source:
        raise ValueError(f"{what} is an empty mapping")
    tensors = [isinstance(v, torch.Tensor) for v in source.values()]
    if all(tensors):
        # A plain state_dict: {"0.weight": tensor, ...}.
        return TensorDict({k: v for k, v in source.items()}).unflatten_keys("."), None
    if any(tensors):  # a state dict with a stray entry: name that entry, not a valid one
        key, value = next((k, v) for k, v in source.items() if not isinstance(v, torch.Tensor))
        raise TypeError(f"{what}: state dict entry {key!r} is a {type(value).__name__}, not a tensor")
    td = TensorDict()
    for dest, value in source.items():
        if not isinstance(dest, str) or not dest:
            raise ValueError(f"{what}: destination names must be non-empty strings, got {dest!r}")
        sub, _ = as_tensordict(value, what=f"{what}[{dest!r}]")
        td.set(dest, sub)
    return td, tuple(source.keys())


def is_destinations(source: Any) -> bool:
    """Whether ``source`` is a mapping of destinations (not a TensorDict, not a state dict)."""
    return (
        isinstance(source, Mapping)
        and not isinstance(source, TensorDictBase)
        and bool(source)
        and not any(isinstance(v, torch.Tensor) for v in source.values())
    )


def parts(
    source: Any, destinations: tuple[str, ...] | None, what: str, *, subset: bool = False
) -> list[tuple[tuple[str, ...], Any]]:
    """``(key prefix, part)`` pairs of ``source`` for a store holding ``destinations`` (None for a
    store made from one module or TensorDict): ``[((), source)]``, or for a mapping of destinations
    one pair per destination, ``((destination,), its weights)``, in the layout's (sorted) order.

    Args:
        subset: a mapping may name some of the destinations only (a reader loading some).

    Raises:
        WeightMismatchError: a mapping of destinations for a store without them, or one naming
            destinations the store does not hold (or, unless ``subset``, missing some).
    """
    if not is_destinations(source):
        return [((), source)]
    names = [str(k) for k in source]
    if destinations is None:
        raise WeightMismatchError(
            f"{what}: the store was created from a single module, without destinations, but got "
            f"destinations {sorted(names)}; create the store from that mapping "
            f"(WeightStore.create({{{', '.join(repr(k) + ': ...' for k in names)}}})) or pass the module itself"
        )
    if not subset and set(source) != set(destinations):
        raise WeightMismatchError(f"{what}: the store holds destinations {sorted(destinations)}, got {sorted(names)}")
    unknown = [k for k in source if k not in destinations]
    if unknown:
        raise WeightMismatchError(f"{what}: the store has no destination {unknown[0]!r} (it has {list(destinations)})")
    return [((d,), source[d]) for d in sorted(source)]


class SourceMatcher:
    """Checks what is published against a store's layout (keys, shapes, dtypes) and returns its
    tensors in entry order. The trainer publishes the same object again and again (its module,
    or a collector's mapping of keys to modules): when the source is the object checked last time
    and each of its modules still holds the very same tensors, with the same shapes and dtypes,
    the full check is skipped. A TensorDict checked before is skipped the same way.

    Args:
        layout: the store's layout.
        destinations: its destination names, or None.

    Examples:
        >>> import torch
        >>> from shmsync.writer.layout import Layout
        >>> policy = torch.nn.Linear(2, 1)
        >>> matcher = SourceMatcher(Layout.from_tensordict(module_weights(policy)), None)
        >>> [tuple(t.shape) for t in matcher.match(policy, "policy")]
        [(1,), (1, 2)]
    """

    def __init__(self, layout: Any, destinations: tuple[str, ...] | None) -> None:
        self.layout, self.destinations = layout, destinations
        self._last: tuple | None = None  # (source, its modules, their tensors, the tensors in entry order)
        self._plans: dict = {}  # ("td", id, prefix) -> what _tensordict checked last time

    def match(self, source: Any, what: str) -> list[torch.Tensor]:
        """The source's tensors in entry order, checked against the layout (nothing written)."""
        last = self._last
        if last is not None and last[0] is source:
            _, modules, before, tensors = last
            owned = [
                t
                for m in modules
                for sub in m.modules()
                for named in (
                    sub.named_parameters(recurse=False, remove_duplicate=False),
                    sub.named_buffers(recurse=False, remove_duplicate=False),
                )
                for _, t in named
                if t is not None
            ]
            entries = self.layout.entries
            if (
                len(owned) == len(before)
                and all(a is b for a, b in zip(owned, before))
                and all(t.shape == e.shape and t.dtype == e.dtype and not t.is_meta for t, e in zip(tensors, entries))
            ):
                return tensors
        tensors = []
        modules = []
        for prefix, part in parts(source, self.destinations, what):
            where = f"{what}, destination {prefix[0]!r}" if prefix else what
            if isinstance(part, nn.Module):
                tensors += self.layout.match(module_weights(part), where, prefix=prefix)
                modules.append(part)
            elif isinstance(part, TensorDictBase):
                tensors += self._tensordict(part, prefix, where)
            else:
                sub, _ = as_tensordict(part, where)
                tensors += self.layout.match(sub, where, prefix=prefix)
        # Sources made of modules alone, whose tensors are each owned once: the next match of the
        # same source skips the walk above while its modules hold the very same tensors.
        owned = [
            t
            for m in modules
            for sub in m.modules()
            for named in (
                sub.named_parameters(recurse=False, remove_duplicate=False),
                sub.named_buffers(recurse=False, remove_duplicate=False),
            )
            for _, t in named
            if t is not None
        ]
        mine = {id(t) for t in owned}
        if (
            modules
            and len(modules) == len(parts(source, self.destinations, what))
            and all(id(t) in mine for t in tensors)
        ):
            self._last = (source, modules, owned, tensors)
        return tensors

    def _tensordict(self, td: TensorDictBase, prefix: tuple[str, ...], what: str) -> list[torch.Tensor]:
        """``layout.match`` for a TensorDict, with a fast path for one checked before: if each of
        its keys still holds the very same tensor, with the same shape and dtype, the full walk
        over its keys is skipped (an update checks, then publishes, the same TensorDict)."""
        plan_key = ("td", id(td), prefix)
        cached = self._plans.get(plan_key)
        if cached is not None:
            ref, paths, before, entries = cached
            if ref() is td and all(
                td.get(path, None) is t and t.shape == e.shape and t.dtype == e.dtype
                for path, t, e in zip(paths, before, entries)
            ):
                return list(before)
        sub, _ = as_tensordict(td, what)
        tensors = self.layout.match(sub, what, prefix=prefix)
        if sub is td:  # keys as stored (not a flat state-dict-like TensorDict)
            layout = self.layout
            entries = [layout.entries[i] for i in layout.subset(prefix)]
            paths = [e.key[len(prefix) :] for e in entries]
            if len(self._plans) >= 32:  # TensorDicts made afresh for each update must not pile up
                self._plans.pop(next(iter(self._plans)))
            self._plans[plan_key] = (weakref.ref(td), paths, tensors, entries)
        return tensors
