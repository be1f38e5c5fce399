"""What users pass as weights (a module, a TensorDict, a state dict, or a mapping of destinations
to any of those), in the one place that tells them apart: :func:`parts` splits a source by the
store's destinations, :func:`as_tensordict` turns one part into a TensorDict."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

from shmsync.errors import ArgumentTypeError, InvalidArgumentError, WeightMismatchError


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
    raise ArgumentTypeError(
        f"{what} must be an nn.Module, a TensorDict, or a mapping destination -> module/TensorDict; "
        f"got {type(source).__name__}"
    )


def _mapping_as_tensordict(source: Mapping, what: str) -> tuple[TensorDictBase, tuple[str, ...] | None]:
    """A state dict (``{"0.weight": tensor}``), or destinations (``{"policy": module, ...}``)."""
    if not source:
        raise InvalidArgumentError(f"{what} is an empty mapping")
    tensors = [isinstance(v, torch.Tensor) for v in source.values()]
    if all(tensors):
        # A plain state_dict: {"0.weight": tensor, ...}.
        return TensorDict({k: v for k, v in source.items()}).unflatten_keys("."), None
    if any(tensors):  # a state dict with a stray entry: name that entry, not a valid one
        key, value = next((k, v) for k, v in source.items() if not isinstance(v, torch.Tensor))
        raise ArgumentTypeError(f"{what}: state dict entry {key!r} is a {type(value).__name__}, not a tensor")
    td = TensorDict()
    for dest, value in source.items():
        if not isinstance(dest, str) or not dest:
            raise InvalidArgumentError(f"{what}: destination names must be non-empty strings, got {dest!r}")
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


class CheckedSource(NamedTuple):
    """A source :class:`SourceMatcher` checked whole, kept for its fast path."""

    source: Any  # the object published
    keys: set | None  # its keys, for a mapping of destinations (None: one module or TensorDict)
    parts: list[tuple[Any, list | None]]  # each module or TensorDict in it, with its leaf keys (None: a module)
    modules: list[nn.Module]  # every module of those parts, each once
    held: list[Any]  # what those parts held (see _held), kept alive here
    tensors: list[torch.Tensor]  # what was published, in the layout's entry order


class SourceMatcher:
    """Checks what is published against a store's layout (keys, shapes, dtypes) and returns its
    tensors in entry order.

    The trainer publishes the same objects again and again: its module, a TensorDict of its
    weights, or a mapping of destinations to those. When the source is the one checked last time
    (the same object, or a mapping with the same keys holding the same objects) and each module or
    TensorDict in it still holds the very same tensors, with the same shapes and dtypes, the full
    check is skipped: a few identity comparisons instead of a walk over the layout.

    Args:
        layout: the store's layout.
        destinations: its destination names, or None.

    Examples:
        >>> import torch
        >>> from shmsync.store.layout import Layout
        >>> policy = torch.nn.Linear(2, 1)
        >>> matcher = SourceMatcher(Layout.from_tensordict(module_weights(policy)), None)
        >>> [tuple(t.shape) for t in matcher.match(policy, "policy")]
        [(1,), (1, 2)]
    """

    def __init__(self, layout: Any, destinations: tuple[str, ...] | None) -> None:
        self.layout, self.destinations = layout, destinations
        self._last: CheckedSource | None = None
        self._shapes = [torch.Size(e.shape) for e in layout.entries]
        self._dtypes = [e.dtype for e in layout.entries]

    def match(self, source: Any, what: str) -> list[torch.Tensor]:
        """The source's tensors in entry order, checked against the layout (nothing written)."""
        last = self._last
        if last is not None:
            now = source.values() if type(source) is dict else (source,)
            same = source is last.source or (
                last.keys is not None and type(source) is dict and source.keys() == last.keys
            )
            # The very parts of last time, holding the very modules and tensors (kept in `_last`,
            # so the same object), shaped and typed as published.
            if same and _all_same(now, [p for p, _ in last.parts]) and _all_same(_held(last), last.held):
                tensors = last.tensors
                if (
                    list(map(_shape, tensors)) == self._shapes
                    and list(map(_dtype, tensors)) == self._dtypes
                    and not any(map(_is_meta, tensors))
                ):
                    return tensors
        return self._match(source, what)

    def _match(self, source: Any, what: str) -> list[torch.Tensor]:
        """The full check, destination by destination (entries are sorted by key, so destinations
        come in sorted order, as :func:`parts` gives them); remembers a source made of modules and
        TensorDicts whose tensors it holds itself, for :meth:`match`'s fast path."""
        tensors: list[torch.Tensor] = []
        for prefix, part in parts(source, self.destinations, what):
            where = f"{what}, destination {prefix[0]!r}" if prefix else what
            sub = module_weights(part) if isinstance(part, nn.Module) else as_tensordict(part, where)[0]
            tensors += self.layout.match(sub, where, prefix=prefix)
        self._remember(source, tensors)
        return tensors

    def _remember(self, source: Any, tensors: list[torch.Tensor]) -> None:
        """Keep what :meth:`match`'s fast path compares, for a source made of modules and
        TensorDicts whose tensors they hold themselves (else nothing: every match is full)."""
        mapping = type(source) is dict
        parts_now = list(source.values()) if mapping else [source]
        self._last = None
        if not all(isinstance(p, (nn.Module, TensorDictBase)) for p in parts_now):
            return
        # A module is watched through its modules' registries, a TensorDict through its leaf keys.
        held_parts = [(p, None if isinstance(p, nn.Module) else list(p.keys(True, True))) for p in parts_now]
        modules = list(dict.fromkeys(m for p, keys in held_parts if keys is None for m in p.modules()))
        last = CheckedSource(source, set(source) if mapping else None, held_parts, modules, [], tensors)
        held = _held(last)
        mine = {id(t) for t in held}
        if all(id(t) in mine for t in tensors):  # each tensor published is one the parts hold
            self._last = last._replace(held=held)


_shape, _dtype, _is_meta = (operator.attrgetter(a) for a in ("shape", "dtype", "is_meta"))


def _all_same(a: Any, b: list[Any]) -> bool:
    """Whether ``a`` holds the very objects of ``b``, in order."""
    a = list(a)
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _held(last: CheckedSource) -> list[Any]:
    """What the parts of ``last`` hold: each module's submodules, parameters and buffers (its own
    registries: a module or tensor swapped anywhere below shows there), each TensorDict's leaves."""
    held: list[Any] = []
    for m in last.modules:
        held += m.children()
        held += m._parameters.values()
        held += m._buffers.values()
    held += [part.get(k, None) for part, keys in last.parts if keys is not None for k in keys]
    return held
