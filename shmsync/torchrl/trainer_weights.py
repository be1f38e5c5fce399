"""The trainer-side weights behind each key of a scheme, whose layout and first version its stores
take: from the collector (``get_model``, a ``policy_factory``), from ``init_on_sender``'s
arguments before any collector exists, or from ``ShmWeightSyncScheme(source=...)``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tensordict import TensorDict, TensorDictBase
from torch import nn

from shmsync.errors import ArgumentTypeError, InvalidArgumentError


def models_of(collector: Any, key: str, source: nn.Module | None, workers: int) -> list[Any]:
    """The trainer-side model for ``key``: one, or one per worker for distinct policy factories.

    Raises:
        ValueError: the key names nothing in the main process, and no source was given.
    """
    if source is not None:
        return [source]
    try:
        model = collector.get_model(key)
        problem = None if isinstance(model, nn.Module) else f"it is a {type(model).__name__}, not a module"
    except (AttributeError, KeyError, IndexError, ValueError) as e:
        model, problem = None, str(e)
    if problem is None:
        return [model]
    factories = list(getattr(collector, "policy_factory", None) or [])
    if key == "policy" and any(factories):
        return _from_factories(factories, workers)
    raise InvalidArgumentError(
        f"weight sync key {key!r} does not resolve to a module on the collector in the main process ({problem}); "
        f"pass ShmWeightSyncScheme(source=the trainer's module for {key!r}), or call "
        f"scheme.init_on_sender(model=..., devices=..., model_id={key!r}) before building the collector"
    )


def _from_factories(factories: list[Any], workers: int) -> list[nn.Module]:
    """A model from each distinct policy factory (one, if every worker has the same)."""
    if any(f is None for f in factories):
        raise InvalidArgumentError("weight sync key 'policy': some workers have a policy_factory and some do not")
    distinct = [factories[0]] if all(f is factories[0] for f in factories) else factories
    models = [f() for f in distinct[:workers]]
    bad = [type(m).__name__ for m in models if not isinstance(m, nn.Module)]
    if bad:
        raise InvalidArgumentError(
            f"weight sync key 'policy': the policy_factory made a {bad[0]}, which has no weights"
        )
    return models


def models_without_collector(
    per_worker: bool,
    model: nn.Module | None,
    weights: TensorDictBase | None,
    params_map: dict[int, Any] | None,
    devices: Sequence[Any] | None,
    device_map_fn: Callable[[int, TensorDictBase], TensorDictBase] | None,
    num_workers: int | None,
) -> tuple[list[Any], int | None, bool]:
    """``init_on_sender`` before any collector exists: the initial weights of each store, the
    number of workers when it is known, and whether each worker gets weights of its own.

    Raises:
        ValueError, TypeError: arguments that do not go together, naming them.
    """
    if params_map is not None:
        if any(v is not None for v in (model, weights, devices, device_map_fn, num_workers)):
            raise InvalidArgumentError("init_on_sender(params_map=...) takes no model, weights, devices or num_workers")
        return _from_params_map(params_map, per_worker)
    if (model is None) == (weights is None):
        raise InvalidArgumentError(
            "ShmWeightSyncScheme.init_on_sender() needs the collector (context=, model_id=), "
            "model= or weights= (with devices= or num_workers= for the worker count), "
            "or params_map={worker: weights}"
        )
    if model is not None and not isinstance(model, nn.Module):
        raise ArgumentTypeError(f"model must be an nn.Module, got {type(model).__name__}")
    source = model if model is not None else weights
    if device_map_fn is not None:
        if num_workers is None:
            raise InvalidArgumentError("init_on_sender(device_map_fn=...) needs num_workers")
        td = TensorDict.from_module(model) if model is not None else weights
        return _from_params_map({i: device_map_fn(i, td) for i in range(num_workers)}, per_worker)
    n = len(devices) if devices is not None else num_workers
    if not per_worker:
        return [source], n, False
    if n is None:
        raise InvalidArgumentError("per_worker_weights: pass devices= or num_workers= to init_on_sender()")
    return [source] * n, n, True


def _from_params_map(params_map: Any, per_worker: bool) -> tuple[list[Any], int, bool]:
    if not isinstance(params_map, dict) or sorted(params_map) != list(range(len(params_map))):
        raise InvalidArgumentError(f"params_map must map worker indices 0..n-1 to weights, got keys {list(params_map)}")
    values = [params_map[i] for i in range(len(params_map))]
    if not per_worker and all(v is values[0] for v in values):
        return values[:1], len(values), False
    return values, len(values), True


def per_store(per_key: dict[str, list[Any]], stores: int) -> list[dict[str, Any]]:
    """``{key: model}`` for each store: each key's model for that worker, or its one model."""
    return [{key: m[w] if len(m) > 1 else m[0] for key, m in per_key.items()} for w in range(stores)]


__all__ = ["models_of", "models_without_collector", "per_store"]
