"""What users pass as weights (a module, a TensorDict, a state dict, or a mapping of destinations
to any of those), in the one place that tells them apart: :func:`parts` splits a source by the
store's destinations, :func:`as_tensordict` turns one part into a TensorDict."""

from __future__ import annotations

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
    raise TypeError(
        f"{what} must be an nn.Module, a TensorDict, or a mapping destination -> module/TensorDict; "
        f"got {type(source).__name__}"
    )


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
