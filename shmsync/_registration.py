"""Puts ``"shmsync"`` into TorchRL's weight-sync backend registry (torchrl >= 0.14), so that
``WeightSyncScheme.from_backend("shmsync", ...)`` builds a :class:`~shmsync.ShmWeightSyncScheme`.

``import shmsync`` must stay light (workers and the CLI never load TorchRL), so the entry is
made when TorchRL's registry module is imported, whichever of the two comes first: at once if
it already is, else by a finder that wraps that one module's loading.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

REGISTRY_MODULE = "torchrl.weight_update.weight_sync_schemes"
BACKEND = "shmsync"


class LazyScheme:
    """Stands in the registry until :mod:`shmsync.scheme` is imported (which replaces it with
    the class itself); calling it builds the scheme. TorchRL's registry module is still being
    executed when the entry is made, so the scheme cannot be imported then."""

    def __new__(cls, **kwargs: Any):
        from .scheme import ShmWeightSyncScheme

        return ShmWeightSyncScheme(**kwargs)


def register(module: Any) -> None:
    """Make the registry entry in TorchRL's loaded registry module (nothing before 0.14)."""
    table = getattr(module, "_WEIGHT_SYNC_SCHEMES", None)
    if isinstance(table, dict):
        table.setdefault(BACKEND, LazyScheme)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any = None, target: Any = None):
        if name != REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)  # once; and so the lookup below finds the real spec
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_register(module: Any) -> None:
            exec_module(module)
            register(module)

        loader.exec_module = exec_and_register
        return spec


def install() -> None:
    """Register now if TorchRL's registry is loaded, else as soon as it is."""
    module = sys.modules.get(REGISTRY_MODULE)
    if module is not None:
        register(module)
    elif not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
