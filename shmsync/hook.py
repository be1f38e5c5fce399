"""``UpdateWeights``: TorchRL's trainer hook, with paths that resolve like users write them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from tensordict import TensorDict
from torchrl.trainers import UpdateWeights as _TorchRLUpdateWeights

from ._paths import resolve_path


class UpdateWeights(_TorchRLUpdateWeights):
    """Pushes the trainer's weights every ``update_weights_interval`` batches or optimizer steps.

    A drop-in replacement for :class:`torchrl.trainers.UpdateWeights` (same signature,
    defaults, validation errors, registration stages and state dict) whose
    ``weight_update_map`` source paths also resolve ``[int]`` and ``['key']`` subscripts and
    modules added with ``trainer.register_module``, and are checked when the hook is built
    rather than at the first interval. With a collector that uses
    :class:`~shmsync.ShmWeightSyncScheme`, all mapped destinations are published into one
    store as one new version, with no message to and no wait on any worker.

    Args:
        collector: the collector whose workers receive the weights. Not needed with ``sender``.
        update_weights_interval: push every this many ``interval_unit`` (>= 1). Default: 1.
        policy_weights_getter: a callable returning the weights to push (legacy form).
        weight_update_map: ``{destination: source path on the trainer}``, e.g.
            ``{"policy": "loss_module.actor_network"}``. Takes precedence over the getter.
        trainer: the trainer; needed for ``weight_update_map`` and ``"optim_steps"``.

    Keyword Args:
        sender: an object with ``update_weights()``, e.g. ``WeightSender(store, ...)``; then no
            collector is needed.
        interval_unit: ``"batches"`` (registers at ``post_steps``) or ``"optim_steps"``
            (registers at ``post_optim`` and counts the trainer's optimizer steps).

    Examples:
        >>> import torch
        >>> from shmsync import UpdateWeights, WeightSender, WeightStore
        >>> class Trainer:  # any object with the paths; a torchrl Trainer in practice
        ...     _optim_count = 0
        >>> trainer = Trainer()
        >>> trainer.actor = torch.nn.Linear(2, 2)
        >>> store = WeightStore.create({"policy": trainer.actor})
        >>> hook = UpdateWeights(
        ...     update_weights_interval=2,
        ...     trainer=trainer,
        ...     sender=WeightSender(store, {"policy": "actor"}, root=trainer),
        ...     interval_unit="optim_steps",
        ... )
        >>> trainer._optim_count = 2; hook(); store.version
        1
        >>> store.close()
    """

    def __init__(
        self,
        collector: Any | None = None,
        update_weights_interval: int = 1,
        policy_weights_getter: Callable[[Any], Any] | None = None,
        weight_update_map: dict[str, str] | None = None,
        trainer: Any | None = None,
        *,
        sender: Any | None = None,
        interval_unit: Literal["batches", "optim_steps"] = "batches",
    ) -> None:
        super().__init__(
            collector,
            update_weights_interval,
            policy_weights_getter,
            weight_update_map,
            trainer,
            sender=sender,
            interval_unit=interval_unit,
        )
        if weight_update_map is not None:
            self._resolve_all()
            schemes = getattr(collector, "_weight_sync_schemes", None)
            unknown = [d for d in weight_update_map if schemes and d not in schemes]
            if unknown:
                raise ValueError(
                    f"weight_update_map destination {unknown[0]!r} has no weight sync scheme on the collector "
                    f"(it has {sorted(schemes)})"
                )

    def _resolve_all(self) -> dict[str, Any]:
        return {dest: resolve_path(self.trainer, path) for dest, path in self.weight_update_map.items()}

    def _update_with_map(self) -> None:
        from torchrl.weight_update.weight_sync_schemes import WeightStrategy

        schemes = getattr(self.collector, "_weight_sync_schemes", None) or {}
        weights_dict = {}
        # Resolve every path before sending anything: a bad path changes nothing.
        for destination, module in self._resolve_all().items():
            scheme = schemes.get(destination)
            if scheme is not None:
                weights_dict[destination] = WeightStrategy(extract_as=scheme.strategy_str).extract_weights(module)
            else:
                weights_dict[destination] = TensorDict.from_module(module)
        self.collector.update_policy_weights_(weights_dict=weights_dict)
