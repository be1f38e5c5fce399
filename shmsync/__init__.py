"""shmsync: versioned shared-memory weights for RL rollout workers on one host.

The trainer publishes into a :class:`WeightStore`; workers load the newest complete
version with a :class:`WeightReader` when, and only when, it changed.
:class:`UpdateWeights` and :class:`ShmWeightSyncScheme` plug into TorchRL.

Names are imported on first use, so ``import shmsync`` (and the ``shmsync`` command) stays
light; the store and the reader never import TorchRL, and ``import shmsync`` changes nothing in
TorchRL. Importing the scheme (``from shmsync import ShmWeightSyncScheme``, or
``import shmsync.torchrl.scheme``) makes ``"shmsync"`` a backend of TorchRL's
``WeightSyncScheme.from_backend`` (torchrl >= 0.14), as importing TorchRL's own scheme modules does
for theirs.
"""

from __future__ import annotations

import importlib
from typing import Any

from shmsync.errors import UnknownAttributeError

__version__ = "0.2.0"  # the one place the version is written (pyproject.toml reads it)

# The public names, and where each lives: the one list (``__all__`` and ``dir(shmsync)`` read it).
# Each is imported on first use; a type checker finds them in those modules.
_LAZY = {
    "WeightStore": "shmsync.writer.store",
    "Snapshot": "shmsync.writer.store",
    "WeightReader": "shmsync.reader.reader",
    "WeightSender": "shmsync.torchrl.sender",
    "UpdateWeights": "shmsync.torchrl.hooks",
    "LogLag": "shmsync.torchrl.hooks",
    "ShmWeightSyncScheme": "shmsync.torchrl.scheme",
    "TorchRLChangedError": "shmsync.torchrl.compat",
    "ReaderTable": "shmsync.store.reader_table",
    "ReaderRow": "shmsync.store.reader_table",
    "ReaderAlarm": "shmsync.watch.alarm",
    "lag_stats": "shmsync.watch.frames",
    "staleness": "shmsync.watch.frames",
    "tag_versions": "shmsync.watch.frames",
    "exit_with_parent": "shmsync.core.processes",
    "ShmSyncError": "shmsync.errors",
    "StaleReaderError": "shmsync.errors",
    "StoreNotFoundError": "shmsync.errors",
    "NotLoadedError": "shmsync.errors",
    "SharedWeightsWrittenError": "shmsync.errors",
    "WeightMismatchError": "shmsync.errors",
    "WriterBusyError": "shmsync.errors",
    "ReloadTimeoutError": "shmsync.errors",
    "WriterGoneError": "shmsync.errors",
    "ClosedError": "shmsync.errors",
    "NotAttachedError": "shmsync.errors",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise UnknownAttributeError(f"module 'shmsync' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
