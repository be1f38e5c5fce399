"""Tagging each frame with the version of the weights that produced it."""

from __future__ import annotations

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

    def hook(mod, args, output):
        if isinstance(output, TensorDictBase):
            output.set(key, torch.full(output.batch_size, version(), dtype=torch.int64, device=output.device))

    module.register_forward_hook(hook)
