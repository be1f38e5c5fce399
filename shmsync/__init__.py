"""shmsync: versioned shared-memory weights for RL rollout workers on one host.

The trainer publishes into a :class:`WeightStore`; workers load the newest complete
version with a :class:`WeightReader` when, and only when, it changed. The store and
the reader import without TorchRL; :class:`UpdateWeights` and
:class:`ShmWeightSyncScheme` plug into TorchRL and are imported on first use.
"""

from __future__ import annotations

from typing import Any

from .errors import (
    ReloadTimeoutError,
    ShmSyncError,
    StoreNotFoundError,
    WeightMismatchError,
    WriterBusyError,
)
from .reader import WeightReader
from .sender import WeightSender
from .store import Snapshot, WeightStore

__version__ = "0.1.0"

_LAZY = {
    "UpdateWeights": "shmsync.hook",
    "ShmWeightSyncScheme": "shmsync.scheme",
    "staleness": "shmsync.versions",
}


def __getattr__(name: str) -> Any:
    # TorchRL-facing names load torchrl only when asked for.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shmsync' has no attribute {name!r}")


__all__ = [
    "ReloadTimeoutError",
    "ShmSyncError",
    "ShmWeightSyncScheme",
    "Snapshot",
    "StoreNotFoundError",
    "UpdateWeights",
    "WeightMismatchError",
    "WeightReader",
    "WeightSender",
    "WeightStore",
    "WriterBusyError",
    "staleness",
]
