"""shmsync: versioned shared-memory weights for RL rollout workers on one host.

The trainer publishes into a :class:`WeightStore`; workers load the newest complete
version with a :class:`WeightReader` when, and only when, it changed.
:class:`UpdateWeights` and :class:`ShmWeightSyncScheme` plug into TorchRL.

Names are imported on first use, so ``import shmsync`` (and the ``shmsync`` command) stays
light; the store and the reader never import TorchRL. The one thing ``import shmsync`` does in
TorchRL is to make ``"shmsync"`` a backend of ``WeightSyncScheme.from_backend`` (torchrl >= 0.14),
through TorchRL's public registry; TorchRL's classes and modules are left as they are.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from shmsync.torchrl import registration

__version__ = "0.1.0"

registration.install()

_LAZY = {
    "WeightStore": "shmsync.writer.store",
    "Snapshot": "shmsync.writer.store",
    "WeightReader": "shmsync.reader.reader",
    "WeightSender": "shmsync.torchrl.sender",
    "UpdateWeights": "shmsync.torchrl.hooks",
    "LogLag": "shmsync.torchrl.hooks",
    "lag_stats": "shmsync.watch.frames",
    "ReaderTable": "shmsync.store.reader_table",
    "ReaderRow": "shmsync.store.reader_table",
    "ReaderAlarm": "shmsync.watch.alarm",
    "StaleReaderError": "shmsync.errors",
    "ShmWeightSyncScheme": "shmsync.torchrl.scheme",
    "staleness": "shmsync.watch.frames",
    "tag_versions": "shmsync.watch.frames",
    "exit_with_parent": "shmsync.core.processes",
    "ShmSyncError": "shmsync.errors",
    "StoreNotFoundError": "shmsync.errors",
    "NotLoadedError": "shmsync.errors",
    "SharedWeightsWrittenError": "shmsync.errors",
    "WeightMismatchError": "shmsync.errors",
    "WriterBusyError": "shmsync.errors",
    "ReloadTimeoutError": "shmsync.errors",
    "WriterGoneError": "shmsync.errors",
    "TorchRLChangedError": "shmsync.torchrl.compat",
}

if TYPE_CHECKING:
    from shmsync.core.processes import exit_with_parent
    from shmsync.errors import (
        NotLoadedError,
        ReloadTimeoutError,
        SharedWeightsWrittenError,
        ShmSyncError,
        StaleReaderError,
        StoreNotFoundError,
        WeightMismatchError,
        WriterBusyError,
        WriterGoneError,
    )
    from shmsync.reader.reader import WeightReader
    from shmsync.store.reader_table import ReaderRow, ReaderTable
    from shmsync.torchrl.compat import TorchRLChangedError
    from shmsync.torchrl.hooks import LogLag, UpdateWeights
    from shmsync.torchrl.scheme import ShmWeightSyncScheme
    from shmsync.torchrl.sender import WeightSender
    from shmsync.watch.alarm import ReaderAlarm
    from shmsync.watch.frames import lag_stats, staleness, tag_versions
    from shmsync.writer.store import Snapshot, WeightStore


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shmsync' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = [
    "LogLag",
    "NotLoadedError",
    "SharedWeightsWrittenError",
    "ReaderAlarm",
    "ReaderRow",
    "ReaderTable",
    "ReloadTimeoutError",
    "StaleReaderError",
    "ShmSyncError",
    "ShmWeightSyncScheme",
    "Snapshot",
    "StoreNotFoundError",
    "TorchRLChangedError",
    "UpdateWeights",
    "WeightMismatchError",
    "WeightReader",
    "WeightSender",
    "WeightStore",
    "WriterBusyError",
    "WriterGoneError",
    "exit_with_parent",
    "lag_stats",
    "staleness",
    "tag_versions",
]
