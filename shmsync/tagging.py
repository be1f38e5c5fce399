"""Tagging each frame with the version of the weights that produced it."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch
from tensordict import TensorDictBase
from torch import nn


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

    warned = []

    def hook(mod, args, output):
        if not isinstance(output, TensorDictBase):
            return
        existing = output.get(key, None)
        if existing is not None and existing.dtype != torch.int64:
            # Someone else's tag under the same key (a transform, the script): leave it whole.
            if not warned:
                warned.append(True)
                warn_clash(key, existing.dtype)
            return
        output.set(key, torch.full(output.batch_size, version(), dtype=torch.int64, device=output.device))

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
