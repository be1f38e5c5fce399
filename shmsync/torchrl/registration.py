"""The one thing ``import shmsync`` does in TorchRL: the ``"shmsync"`` entry of TorchRL's
weight-sync backend registry (torchrl >= 0.14), made through TorchRL's public
``register_weight_sync_backend``, so that ``WeightSyncScheme.from_backend("shmsync", ...)`` builds
a :class:`~shmsync.ShmWeightSyncScheme` whichever of the two is imported first.

``import shmsync`` must stay light (workers and the CLI never load TorchRL), so the entry is made
at once if TorchRL's registry module is loaded, else right after it loads: a finder on
``sys.meta_path`` waits for that one module, runs its code unchanged, then makes the entry, and
removes itself. No other TorchRL module, class or attribute is touched.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

from shmsync.torchrl import releases

REGISTRY_MODULE = "torchrl.weight_update.weight_sync_schemes"
BACKEND = "shmsync"


class LazyScheme:
    """Stands in the registry until :mod:`shmsync.torchrl.scheme` is imported (which replaces it with
    the class itself); calling it builds the scheme. TorchRL's registry module is still being
    executed when the entry is made, so the scheme cannot be imported then."""

    def __new__(cls, **kwargs: Any):
        from shmsync.torchrl.scheme import ShmWeightSyncScheme

        return ShmWeightSyncScheme(**kwargs)


def register(module: Any) -> None:
    """Make the registry entry in TorchRL's loaded registry module (torchrl >= 0.14)."""
    register_backend = getattr(module, "register_weight_sync_backend", None)
    if callable(register_backend) and _supported():
        register_backend(BACKEND)(LazyScheme)


def _supported() -> bool:
    """Whether the installed torchrl (or torchrl-nightly) is one shmsync supports, read from its
    metadata: TorchRL is not imported for this. Outside that range the scheme refuses to import,
    saying why."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("torchrl", "torchrl-nightly"):  # in TorchRL's own order
        try:
            return releases.refusal(version(distribution)) is None
        except PackageNotFoundError:
            continue
    return False


class _AfterRegistryLoads(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when TorchRL's registry module is looked up, it hands out that
    module's own spec with a loader that runs the module's code, then :func:`register`."""

    def find_spec(self, name: str, path: Any = None, target: Any = None):
        if name != REGISTRY_MODULE:
            return None
        sys.meta_path.remove(self)  # once: and the lookup below must not find this finder
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        spec.loader = _ThenRegister(loader)
        return spec


class _ThenRegister(importlib.abc.Loader):
    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        # The module ends up as any import leaves it: its own loader in its spec.
        module.__loader__ = module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        register(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... as the real loader has them
        return getattr(self.loader, name)


def install() -> None:
    """Make the registry entry now if TorchRL's registry is loaded, else as soon as it is."""
    module = sys.modules.get(REGISTRY_MODULE)
    if module is not None:
        register(module)
    elif not any(isinstance(f, _AfterRegistryLoads) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterRegistryLoads())
