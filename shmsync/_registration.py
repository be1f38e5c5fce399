"""What ``import shmsync`` sets up in TorchRL, without importing it: each part is done when the
TorchRL module it concerns is imported, whichever of the two comes first (at once if it already
is, else by a finder that wraps that module's loading).

- ``"shmsync"`` in TorchRL's weight-sync backend registry (torchrl >= 0.14), so that
  ``WeightSyncScheme.from_backend("shmsync", ...)`` builds a :class:`~shmsync.ShmWeightSyncScheme`.
- TorchRL's distributed collectors made ready for shmsync as each node's local scheme (see
  :mod:`shmsync._distributed`), and its Ray scheme made to carry the trainer's versions (see
  :mod:`shmsync._ray`).

``import shmsync`` must stay light (workers and the CLI never load TorchRL or torch).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
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
    """Make the registry entry in TorchRL's loaded registry module (torchrl >= 0.14), through its
    own ``register_weight_sync_backend``."""
    register_backend = getattr(module, "register_weight_sync_backend", None)
    if callable(register_backend):
        register_backend(BACKEND)(LazyScheme)


def _supported() -> bool:
    """Whether the installed torchrl is one shmsync supports (read from its metadata: TorchRL is not
    imported for this). Outside that range shmsync changes nothing in TorchRL; its scheme and hook
    then refuse to import, saying why."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        minor = tuple(int(p) for p in version("torchrl").split("+")[0].split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return False
    return (0, 11) <= minor <= (0, 14)


def _glue(module_name: str, patch: str) -> Callable[[Any], None]:
    def run(module: Any) -> None:
        if _supported():
            getattr(importlib.import_module(module_name), patch)(module)

    return run


ON_IMPORT: dict[str, Callable[[Any], None]] = {
    REGISTRY_MODULE: register,
    "torchrl.collectors.distributed.sync": _glue("shmsync._distributed", "patch_sync_module"),
    "torchrl.collectors.distributed.generic": _glue("shmsync._distributed", "patch_generic_module"),
    "torchrl.weight_update._distributed": _glue("shmsync._distributed", "patch_scheme_module"),
    "torchrl.weight_update._ray": _glue("shmsync._ray", "patch_scheme_module"),
}


class _OnImport(importlib.abc.MetaPathFinder):
    def __init__(self, pending: dict[str, Callable[[Any], None]]) -> None:
        self.pending = pending

    def find_spec(self, name: str, path: Any = None, target: Any = None):
        callback = self.pending.pop(name, None)
        if callback is None:
            return None
        if not self.pending:
            sys.meta_path.remove(self)
        # Not seen by this finder any more, so the lookup below finds the real spec.
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            callback(module)

        loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    """Set up each part now if its TorchRL module is loaded, else as soon as it is."""
    if any(isinstance(f, _OnImport) for f in sys.meta_path):
        return
    pending = {}
    for name, callback in ON_IMPORT.items():
        module = sys.modules.get(name)
        if module is not None:
            callback(module)
        else:
            pending[name] = callback
    if pending:
        sys.meta_path.insert(0, _OnImport(pending))
