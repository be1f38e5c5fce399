"""TorchRL trainer hooks: ``UpdateWeights``, with paths that resolve like users write them, and
``LogLag``, the policy lag of each batch for the trainer's logger and progress bar."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from tensordict import TensorDict
from torchrl.trainers import UpdateWeights as _TorchRLUpdateWeights

from shmsync.errors import InvalidArgumentError, warn_deprecated
from shmsync.torchrl import compat
from shmsync.torchrl.attribute_paths import resolve_path
from shmsync.watch.frames import lag_stats

HOOK_TAKES_SENDER = compat.hook_takes_sender(_TorchRLUpdateWeights)


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
        versioning: what a published version counts. ``"publishes"`` (default): one more per
            update. ``"optim_steps"``: the trainer's optimizer-step count at the update, so
            the version a frame carries (and the staleness computed from it) is in optimizer
            steps; an update with no optimizer step since the last one publishes nothing (the
            weights did not change). Needs a collector whose schemes are all
            :class:`~shmsync.ShmWeightSyncScheme`, or a :class:`~shmsync.WeightSender`.
        version: deprecated: ``versioning`` (its name until 0.2.0; removed in 0.4.0).

    Examples:
        >>> import torch
        >>> from shmsync import UpdateWeights, WeightSender, WeightStore
        >>> class Trainer:  # any object with the paths; a torchrl Trainer in practice
        ...     pass
        >>> trainer = Trainer()
        >>> trainer.actor = torch.nn.Linear(2, 2)
        >>> store = WeightStore.create({"policy": trainer.actor})
        >>> hook = UpdateWeights(
        ...     update_weights_interval=2,
        ...     trainer=trainer,
        ...     sender=WeightSender(store, {"policy": "actor"}, root=trainer),
        ... )
        >>> hook(); store.version  # the first batch: not yet
        0
        >>> hook(); store.version  # the second: published
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
        versioning: Literal["publishes", "optim_steps"] = "publishes",
        version: Literal["publishes", "optim_steps"] | None = None,
    ) -> None:
        if version is not None:
            warn_deprecated("UpdateWeights(version=...)", "UpdateWeights(versioning=...)", "0.4.0")
            versioning = version
        if versioning not in ("publishes", "optim_steps"):
            raise InvalidArgumentError(f"versioning must be 'publishes' or 'optim_steps', got {versioning!r}")
        if HOOK_TAKES_SENDER:
            super().__init__(
                collector,
                update_weights_interval,
                policy_weights_getter,
                weight_update_map,
                trainer,
                sender=sender,
                interval_unit=interval_unit,
            )
        else:  # torchrl <= 0.13: its hook has no sender and counts batches only; this one does both
            compat.check_hook_arguments(
                collector,
                update_weights_interval,
                policy_weights_getter,
                weight_update_map,
                trainer,
                sender,
                interval_unit,
            )
            super().__init__(collector, update_weights_interval, policy_weights_getter, weight_update_map, trainer)
            self.sender, self.interval_unit = sender, interval_unit
        # The interval state is this hook's own (TorchRL's hook keeps its own under other names).
        self.counter = 0
        self._steps_at_last_update = 0  # with interval_unit="optim_steps"
        self.versioning = versioning
        self._version_published = -1  # with versioning="optim_steps": the step count last published
        if versioning == "optim_steps":
            self._check_takes_versions()
        if weight_update_map is not None:
            self._resolve_mapped()
            schemes = compat.schemes_of(collector) if collector is not None else {}
            unknown = [d for d in weight_update_map if schemes and d not in schemes]
            if unknown:
                raise InvalidArgumentError(
                    f"weight_update_map destination {unknown[0]!r} has no weight sync scheme on the collector "
                    f"(it has {sorted(schemes)})"
                )

    def _check_takes_versions(self) -> None:
        from shmsync.torchrl.scheme import ShmWeightSyncScheme
        from shmsync.torchrl.sender import WeightSender

        if self.sender is not None:
            if not isinstance(self.sender, WeightSender):
                raise InvalidArgumentError(
                    f"versioning='optim_steps' needs a shmsync WeightSender, got {type(self.sender).__name__}"
                )
            return
        schemes = compat.schemes_of(self.collector)
        others = [k for k, s in schemes.items() if not isinstance(s, ShmWeightSyncScheme)]
        if not schemes or others:
            raise InvalidArgumentError(
                "versioning='optim_steps' needs a collector whose weight_sync_schemes are all ShmWeightSyncScheme "
                f"(got {sorted(others) or 'none'} without it), or sender=WeightSender(...)"
            )

    trainer: Any  # TorchRL's hook sets it (the trainer, or None until registered)

    def register(self, trainer: Any, name: str = "update_weights") -> None:
        if self.trainer is None:
            self.trainer = trainer
        trainer.register_module(name, self)
        trainer.register_op("post_optim" if self.interval_unit == "optim_steps" else "post_steps", self)

    def __call__(self) -> None:
        # TorchRL's interval logic, then its three ways to send, each with a version.
        if self.interval_unit == "optim_steps":
            count = compat.optimizer_step_count(self.trainer)
            if count - self._steps_at_last_update < self.update_weights_interval:
                return
            self._steps_at_last_update = count
        else:
            self.counter += 1
            if self.counter % self.update_weights_interval != 0:
                return
        version = compat.optimizer_step_count(self.trainer) if self.versioning == "optim_steps" else None
        if version is not None and version <= self._version_published:
            return  # no optimizer step since the last publish: same weights, and versions never repeat
        if self.sender is not None:
            self.sender.update_weights() if version is None else self.sender.update_weights(version=version)
        elif self.weight_update_map is not None:
            self._publish_mapped(version=version)
        else:
            weights = self.policy_weights_getter() if self.policy_weights_getter is not None else None
            versioned = {} if version is None else {"version": version}
            if weights is not None:
                self.collector.update_policy_weights_(weights, **versioned)
            else:
                self.collector.update_policy_weights_(**versioned)
        if version is not None:
            self._version_published = version

    def state_dict(self) -> dict:
        state = {"counter": self.counter, "last_update_count": self._steps_at_last_update}
        if self.versioning == "optim_steps":
            state["last_version"] = self._version_published
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self.counter = state_dict.get("counter", 0)
        self._steps_at_last_update = state_dict.get("last_update_count", 0)
        self._version_published = state_dict.get("last_version", self._version_published)

    def _resolve_mapped(self) -> dict[str, Any]:
        return {
            dest: resolve_path(self.trainer, path, fallback=compat.registered_module)
            for dest, path in self.weight_update_map.items()
        }

    def _publish_mapped(self, version: int | None = None) -> None:
        from torchrl.weight_update.weight_sync_schemes import WeightStrategy

        schemes = compat.schemes_of(self.collector)
        weights_dict = {}
        # Resolve every path before sending anything: a bad path changes nothing.
        for destination, module in self._resolve_mapped().items():
            scheme = schemes.get(destination)
            if scheme is not None:
                weights_dict[destination] = WeightStrategy(extract_as=scheme.strategy_str).extract_weights(module)
            else:
                weights_dict[destination] = TensorDict.from_module(module)
        if version is None:
            self.collector.update_policy_weights_(weights_dict=weights_dict)
        else:
            self.collector.update_policy_weights_(weights_dict=weights_dict, version=version)


class LogLag:
    """A TorchRL trainer hook that logs the policy lag of each batch, and of the workers now.

    Registered on a :class:`torchrl.trainers.Trainer`, it reports once per collected batch (the
    ``"pre_steps_log"`` stage) what :func:`shmsync.watch.frames.lag_stats` computes: how many
    versions behind the trainer each frame of the batch was collected (mean, min, max) and how
    far behind each live worker is now (mean, min, max, and how many). The trainer's logger
    (TensorBoard, W&B, CSV...) records every figure; the progress bar shows the largest lag of
    the batch's frames, ``lag``.

    Args:
        scheme: the collector's :class:`~shmsync.ShmWeightSyncScheme` (or a store, or anything
            with ``version`` and ``readers()``).
        key: the version key the frames carry.
        log_pbar: show ``lag`` in the trainer's progress bar.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from shmsync import WeightStore
        >>> store = WeightStore.create(torch.nn.Linear(2, 2))
        >>> store.publish(torch.nn.Linear(2, 2))
        1
        >>> batch = TensorDict({"policy_version": torch.tensor([0, 1])}, batch_size=[2])
        >>> LogLag(store)(batch)["policy_lag/frames_max"]
        1.0
        >>> store.close()

        On a trainer: ``LogLag(scheme).register(trainer)``.
    """

    def __init__(self, scheme: Any, key: str = "policy_version", log_pbar: bool = True) -> None:
        self.scheme, self.key, self.log_pbar = scheme, key, log_pbar

    def __call__(self, batch: Any) -> dict[str, Any]:
        stats: dict[str, Any] = lag_stats(batch, self.scheme, self.key)
        stats["log_pbar"] = False
        return stats

    def progress(self, batch: Any) -> dict[str, Any]:
        """The progress bar's figure: the largest lag of the batch's frames."""
        stats = lag_stats(batch, int(self.scheme.version), self.key)
        return {"lag": stats.get("policy_lag/frames_max", 0.0), "log_pbar": True}

    def register(self, trainer: Any, name: str = "log_lag") -> None:
        """Log at every batch of ``trainer`` (and show ``lag`` in its progress bar)."""
        trainer.register_op("pre_steps_log", self)
        if self.log_pbar:
            trainer.register_op("pre_steps_log", self.progress)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass
