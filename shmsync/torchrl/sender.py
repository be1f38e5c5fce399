"""A sender: the object TorchRL's ``UpdateWeights(sender=...)`` calls ``update_weights()`` on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shmsync.errors import InvalidArgumentError
from shmsync.torchrl.attribute_paths import resolve_path
from shmsync.writer.store import WeightStore


class WeightSender:
    """Publishes a fixed source into a store each time :meth:`update_weights` is called.

    Args:
        store: the store to publish into.
        source: what :meth:`WeightStore.publish` takes (a module, a TensorDict, a mapping
            ``{destination: module}``), or a mapping ``{destination: "path.on.root"}`` whose
            paths are resolved on ``root`` at every update (attributes, ``[int]`` and
            ``['key']`` subscripts, and modules registered with ``Trainer.register_module``).
        root: the object paths are resolved on, e.g. a TorchRL ``Trainer``.

    Examples:
        >>> import torch
        >>> from shmsync import WeightSender, WeightStore
        >>> class Trainer: ...
        >>> trainer = Trainer()
        >>> trainer.actor = torch.nn.Linear(2, 2)
        >>> store = WeightStore.create({"policy": trainer.actor})
        >>> sender = WeightSender(store, {"policy": "actor"}, root=trainer)
        >>> sender.update_weights()
        1
        >>> store.close()
    """

    def __init__(self, store: WeightStore, source: Any, *, root: Any = None) -> None:
        self.store = store
        self.source = source
        self.root = root
        self._paths = isinstance(source, Mapping) and any(isinstance(v, str) for v in source.values())
        if self._paths and root is None:
            raise InvalidArgumentError("a source given as paths needs root= (the object the paths are resolved on)")
        # Fail now, not at the first interval: every path resolves and matches the store.
        store.check(self._resolve())

    def _resolve(self) -> Any:
        if not self._paths:
            return self.source
        return {
            dest: resolve_path(self.root, path, fallback=_registered_module) if isinstance(path, str) else path
            for dest, path in self.source.items()
        }

    def update_weights(self, weights: Any = None, *, version: int | None = None) -> int:
        """Publish ``weights`` (default: the source) as one new version; returns it.

        ``version``: publish under this number (say, the optimizer-step count) instead of the
        next one; see :meth:`WeightStore.publish`.
        """
        return self.store.publish(self._resolve() if weights is None else weights, version=version)

    def __repr__(self) -> str:
        return f"WeightSender(store={self.store.name!r})"


def _registered_module(root: Any, name: str) -> Any:
    """A module added with ``Trainer.register_module`` (only looked up when a path needs one)."""
    from shmsync.torchrl.compat import registered_module

    return registered_module(root, name)
