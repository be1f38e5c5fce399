"""What differs between the TorchRL minors shmsync supports (0.11 to 0.14), in one place.

The rest lives where it is used, each marked: the worker's collector found on the call stack
(torchrl 0.12 and older hand it no scheme context, ``_scheme_worker.find_worker_collector``) and
the backend registry entry (0.14 only, ``_registration``).
"""

from __future__ import annotations

import inspect

import torchrl
from torchrl.trainers import UpdateWeights as TorchRLUpdateWeights

TORCHRL_VERSION = tuple(int(p) for p in torchrl.__version__.split("+")[0].split(".")[:2])

# torchrl 0.14 added ``sender=`` and ``interval_unit=`` (optimizer-step intervals) to its hook.
HOOK_TAKES_SENDER = "sender" in inspect.signature(TorchRLUpdateWeights.__init__).parameters


def check_hook_arguments(
    collector, update_weights_interval, policy_weights_getter, weight_update_map, trainer, sender, interval_unit
) -> None:
    """torchrl 0.14's validation of its hook's arguments, for a torchrl whose hook lacks them."""
    if update_weights_interval < 1:
        raise ValueError("update_weights_interval must be >= 1")
    if interval_unit not in ("batches", "optim_steps"):
        raise ValueError(f"interval_unit must be 'batches' or 'optim_steps', got {interval_unit!r}")
    if sender is None and collector is None:
        raise ValueError("either a collector or a sender must be provided")
    if sender is not None and (policy_weights_getter is not None or weight_update_map is not None):
        raise ValueError("sender is mutually exclusive with policy_weights_getter and weight_update_map")
    if weight_update_map is not None and trainer is None:
        raise ValueError("trainer must be provided when using weight_update_map")
    if interval_unit == "optim_steps" and trainer is None:
        raise ValueError("trainer must be provided when interval_unit='optim_steps'")
