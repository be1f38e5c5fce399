"""Turning what users pass (a module, a TensorDict, or a mapping of them) into one TensorDict."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase
from torch import nn

Source = nn.Module | TensorDictBase | Mapping[str, Any]


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
