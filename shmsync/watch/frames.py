"""The version each collected frame carries: tagging frames with the version of the weights that
produced them, how many versions behind the trainer they are, and lag statistics for loggers."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDictBase
from torch import nn

from shmsync.errors import ArgumentTypeError, InvalidArgumentError, UnknownKeyError


def tag_versions(module: nn.Module, version: Callable[[], int], key: str = "policy_version") -> None:
    """After every forward call of ``module``, write ``version()`` into its output TensorDict.

    The tag is read when the frame is produced, so it is the version loaded in the module at
    that moment, whatever was published since. The hook is a plain closure: deep copies of
    the module keep tagging from the same source.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tensordict.nn import TensorDictModule
        >>> policy = TensorDictModule(torch.nn.Linear(3, 1), in_keys=["obs"], out_keys=["action"])
        >>> tag_versions(policy, lambda: 7)
        >>> policy(TensorDict({"obs": torch.zeros(2, 3)}, [2]))["policy_version"].tolist()
        [7, 7]
    """

    warned: list[bool] = []
    # The last tag made, reused while the version, shape and device stay (a collector stacks its
    # frames into a buffer of its own: the tensor is only read). Made anew at every change.
    last: list = [None, None]  # (version, batch size, device) and the tag

    def hook(_mod, _args, output):
        if not isinstance(output, TensorDictBase):
            return
        existing = output.get(key, None)
        if existing is not None and existing.dtype != torch.int64:
            # Someone else's tag under the same key (a transform, the script): leave it whole.
            if not warned:
                warned.append(True)
                warn_clash(key, existing.dtype)
            return
        made = (version(), output.batch_size, output.device)
        if last[0] != made:
            last[:] = made, torch.full(made[1], made[0], dtype=torch.int64, device=made[2])
        output.set(key, last[1])

    module.register_forward_hook(hook)


def warn_clash(key: str, dtype: torch.dtype) -> None:
    warnings.warn(
        f"frames already carry {key!r} ({dtype}), written by something other than shmsync; shmsync leaves it "
        f"alone and tags nothing. Give shmsync its own key: ShmWeightSyncScheme(version_key='shmsync_version')",
        UserWarning,
        stacklevel=3,
    )


def tag_all(batch: TensorDictBase, key: str, version: int) -> None:
    """Tag every frame of ``batch`` with ``version``, in place where the tag exists (the batch may
    live in buffers shared with the trainer); a key someone else writes is left alone."""
    existing = batch.get(key, None)
    if existing is None:
        batch.set(key, torch.full(batch.batch_size, version, dtype=torch.int64, device=batch.device))
    elif existing.dtype == torch.int64:
        existing.fill_(version)


def tag_next(batch: TensorDictBase, key: str) -> None:
    """Copy the frames' version tag to ``("next", key)``, in place where it exists."""
    if key not in batch.keys():
        return
    root, nxt = batch.get(key), batch.get(("next", key), None)
    if root.dtype != torch.int64:
        return  # not shmsync's tag (the policy hook warned)
    if nxt is not None and nxt.dtype != torch.int64:
        warn_clash(f"('next', {key!r})", nxt.dtype)
        return
    if nxt is not None and nxt.shape == root.shape:
        nxt.copy_(root)  # in place: the batch may live in buffers shared with the trainer
    elif "next" in batch.keys():
        batch.set(("next", key), root.clone())


def staleness(
    batch: TensorDictBase, current: Any, key: str = "policy_version", *, unit: str = "versions"
) -> torch.Tensor:
    """How far behind the trainer the weights each frame of ``batch`` ran were.

    Args:
        batch: collected frames carrying ``key`` (as :class:`~shmsync.ShmWeightSyncScheme`
            writes it).
        current: the trainer's current version: an int, or anything with a ``version``
            attribute (a :class:`~shmsync.WeightStore` or the scheme). With
            ``unit="optim_steps"``, a store or a scheme (they know each version's steps).
        key: the version key.
        unit: ``"versions"``: versions published since the frame's; ``"optim_steps"``: optimizer
            steps the trainer took on the weights since the frame's version was published (what
            the frame's weights missed of the training, however many versions that made; see
            :meth:`~shmsync.WeightStore.steps_of`).

    Returns:
        An int64 tensor shaped like ``batch[key]``: 0 for frames of the current weights.

    Raises:
        KeyError: ``batch`` has no ``key``.
        ValueError: ``unit`` is neither, or with ``"optim_steps"``, a frame's version is one the
            store no longer knows (over 4096 publishes old).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> batch = TensorDict({"policy_version": torch.tensor([3, 3, 4])}, batch_size=[3])
        >>> staleness(batch, 5).tolist()
        [2, 2, 1]
        >>> staleness(batch, 5).max().item()
        2

        In optimizer steps, from the store the versions were published into:

        >>> from shmsync import WeightStore
        >>> policy = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
        >>> with WeightStore.create(policy) as store:  # version 0, before any step
        ...     for _ in range(5):
        ...         policy(torch.ones(1, 2)).sum().backward()
        ...         optimizer.step()
        ...     batch = TensorDict({"policy_version": torch.tensor([0, 0])}, batch_size=[2])
        ...     staleness(batch, store, unit="optim_steps").tolist()
        [5, 5]
    """
    if key not in batch.keys(include_nested=isinstance(key, tuple)):
        raise UnknownKeyError(f"the batch has no {key!r} entry: was it collected with ShmWeightSyncScheme?")
    versions = batch.get(key).to(torch.int64)
    if unit == "versions":
        version = current if isinstance(current, int) else int(current.version)
        return version - versions
    if unit != "optim_steps":
        raise InvalidArgumentError(f"unit must be 'versions' or 'optim_steps', got {unit!r}")
    if not callable(getattr(current, "steps_of", None)):
        raise ArgumentTypeError(
            f"staleness(..., unit='optim_steps') needs the store or the scheme, which know each version's steps; "
            f"got {type(current).__name__}"
        )
    now, table = int(current.steps), {}
    for v in versions.unique().tolist():
        then = current.steps_of(int(v))
        if then is None:
            raise InvalidArgumentError(
                f"frames ran version {v}, whose optimizer steps are no longer known (too old, or never published here)"
            )
        table[v] = now - then
    out = versions.clone()
    for v, behind in table.items():
        out[versions == v] = behind
    return out


def lag_stats(
    batch: TensorDictBase | None, current: Any, key: str = "policy_version", *, prefix: str = "policy_lag/"
) -> dict[str, float]:
    """Policy-lag statistics, ready for a logger (TorchRL's ``Logger.log_scalar``, a trainer hook).

    Over the batch's frames: how many versions behind ``current`` they were collected (mean, min,
    max; padding masked out by TorchRL's ``("collector", "mask")`` is left out). Over the live
    readers, when ``current`` has a readers' table (a :class:`~shmsync.ShmWeightSyncScheme` or a
    :class:`~shmsync.WeightStore`): how many versions behind each is now, and how many there are.

    Args:
        batch: collected frames carrying ``key``; None for the readers' figures alone.
        current: the trainer's current version: an int, or a scheme or store (its ``version``).
        key: the version key.
        prefix: put before each name.

    Returns:
        ``{prefix + name: value}`` with names ``frames_mean``, ``frames_min``, ``frames_max``;
        where ``current`` knows each version's optimizer steps (a scheme or store),
        ``frames_steps_mean`` and ``frames_steps_max`` (optimizer steps behind); and with a
        readers' table ``readers``, ``readers_mean``, ``readers_min``, ``readers_max`` (those
        four only when some reader has loaded a version).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> batch = TensorDict({"policy_version": torch.tensor([3, 3, 4, 5])}, batch_size=[4])
        >>> lag_stats(batch, 5)
        {'policy_lag/frames_mean': 1.25, 'policy_lag/frames_min': 0.0, 'policy_lag/frames_max': 2.0}
    """
    out: dict[str, float] = {}
    if batch is not None:
        mask = batch.get(("collector", "mask"), None)
        lag = _unmasked(staleness(batch, current, key), mask)
        if lag.numel():
            out[prefix + "frames_mean"] = round(float(lag.mean()), 6)
            out[prefix + "frames_min"] = float(lag.min())
            out[prefix + "frames_max"] = float(lag.max())
        if callable(getattr(current, "steps_of", None)):
            try:
                steps = _unmasked(staleness(batch, current, key, unit="optim_steps"), mask)
            except InvalidArgumentError:  # a version too old to know its steps: leave them out
                steps = torch.empty(0)
            if steps.numel():
                out[prefix + "frames_steps_mean"] = round(float(steps.mean()), 6)
                out[prefix + "frames_steps_max"] = float(steps.max())
    readers = getattr(current, "readers", None)
    if callable(readers):
        rows = [r.behind for r in readers(processes=False) if r.behind is not None]
        out[prefix + "readers"] = float(len(rows))
        if rows:
            out[prefix + "readers_mean"] = round(sum(rows) / len(rows), 6)
            out[prefix + "readers_min"] = float(min(rows))
            out[prefix + "readers_max"] = float(max(rows))
    return out


def _unmasked(lag: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``lag`` as float64, without the padding TorchRL's ``("collector", "mask")`` marks."""
    if mask is not None and mask.shape == lag.shape[: mask.ndim]:
        lag = lag[mask]
    return lag.to(torch.float64)
