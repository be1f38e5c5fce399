"""Helpers for the policy version that each collected frame carries."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase


def staleness(batch: TensorDictBase, current: Any, key: str = "policy_version") -> torch.Tensor:
    """How many versions behind ``current`` each frame of ``batch`` was collected.

    Args:
        batch: collected frames carrying ``key`` (as :class:`~shmsync.ShmWeightSyncScheme`
            writes it).
        current: the trainer's current version: an int, or anything with a ``version``
            attribute (a :class:`~shmsync.WeightStore` or the scheme).
        key: the version key.

    Returns:
        An int64 tensor shaped like ``batch[key]``: 0 for frames of the current weights.

    Raises:
        KeyError: ``batch`` has no ``key``.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> batch = TensorDict({"policy_version": torch.tensor([3, 3, 4])}, batch_size=[3])
        >>> staleness(batch, 5).tolist()
        [2, 2, 1]
        >>> staleness(batch, 5).max().item()
        2
    """
    if key not in batch.keys(include_nested=isinstance(key, tuple)):
        raise KeyError(f"the batch has no {key!r} entry: was it collected with ShmWeightSyncScheme?")
    version = current if isinstance(current, int) else int(current.version)
    return version - batch.get(key).to(torch.int64)
