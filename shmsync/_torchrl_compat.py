"""Every TorchRL internal shmsync relies on, and every difference between the TorchRL minors it
supports (0.11 to 0.14), in one place.

TorchRL's public extension points do most of the work: the ``WeightSyncScheme`` methods meant
for overriding (``_init_on_sender_impl`` and the rest), its ``model`` and ``context``, the
backend registry (``register_weight_sync_backend``), and ``nn.Module`` hooks on the worker's
policy. What they do not cover is listed in :data:`INTERNALS`, each with the torchrl versions it
was checked on and why no public path does the job. Each is checked the first time it is used:
if TorchRL moved it, :class:`TorchRLChangedError` names it, the installed torchrl and the versions
known to work, instead of shmsync running on a guess.

Whatever path TorchRL takes, no worker runs stale weights quietly: its policy checks the version
at every call (a forward pre-hook, ~0.1 us), so a rollout TorchRL starts without shmsync's poll
still loads the newest version at its first step; and the trainer checks, at its first update,
that every worker attached to the store (:func:`shmsync._scheme_sender.SenderGroup`).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torchrl

from .errors import ShmSyncError

TORCHRL_VERSION = tuple(int(p) for p in torchrl.__version__.split("+")[0].split(".")[:2])
SUPPORTED = ((0, 11), (0, 14))  # the minors make test runs, first and last


def _minor(v: tuple[int, int]) -> str:
    return ".".join(map(str, v))


class TorchRLChangedError(ShmSyncError):
    """A TorchRL internal shmsync relies on is missing or has another shape in the installed
    torchrl: shmsync stops rather than sync weights on a guess."""


if not SUPPORTED[0] <= TORCHRL_VERSION <= SUPPORTED[1]:
    raise ImportError(
        f"shmsync supports torchrl {_minor(SUPPORTED[0])} to {_minor(SUPPORTED[1])}, each minor tested; this is "
        f"torchrl {torchrl.__version__}. Install a torchrl in that range (pip install 'torchrl>={_minor(SUPPORTED[0])},"
        f"<{SUPPORTED[1][0]}.{SUPPORTED[1][1] + 1}'), or a shmsync that supports {_minor(TORCHRL_VERSION)}"
    )


@dataclass(frozen=True)
class Internal:
    """One TorchRL internal: where it lives, the torchrl minors it was checked on, and why."""

    name: str
    versions: str
    why: str


INTERNALS: dict[str, Internal] = {
    i.name: i
    for i in (
        Internal(
            "MultiCollector._weight_sync_schemes",
            "0.11-0.14",
            "the collector's schemes by key: one update call publishes every shmsync key as one version, "
            "and a scheme initialized before its collector finds that collector's other shmsync keys",
        ),
        Internal(
            "MultiCollector.update_policy_weights_ / shutdown / load_state_dict, replaced on the instance",
            "0.11-0.14",
            "public methods, wrapped per collector: the keys staged by one call publish as one version (and "
            "under a version given with version=), shutdown frees the stores at once, and a restored state dict "
            "restores the workers' versions. Without the wrappers each key publishes on its own: nothing goes stale",
        ),
        Internal(
            "the call stack of MultiCollector.connect",
            "0.11-0.14",
            "a scheme initialized before its collector (init_on_sender(model=...)) is handed no collector "
            "when TorchRL connects it; the collector is the caller. Without it: no grouping, no restore",
        ),
        Internal(
            "Collector.rollout, shadowed on the worker's instance",
            "0.11-0.14",
            "polls before each rollout (so a batch runs one version when it can) and copies the version tag "
            "to ('next', key). A pre_collect_hook would do the first, but users may reassign theirs. "
            "Without it the policy's own check still loads every version",
        ),
        Internal(
            "the call stack of the worker's Collector.__init__",
            "0.11-0.12",
            "torchrl 0.11 and 0.12 hand the receiver no collector (0.13 and later set the scheme's context)",
        ),
        Internal(
            "BaseCollector.policy_version_tracker",
            "0.11-0.14",
            "track_policy_version's PolicyVersion transform: its version is set to the version loaded",
        ),
        Internal(
            "BaseCollector._receiver_schemes",
            "0.14",
            "the schemes a node's or a Ray actor's collector receives from: tells a cascade of the "
            "trainer's push from an update of its own",
        ),
        Internal(
            "BaseCollector._set_received_policy_version",
            "0.14",
            "where a Ray actor's collector learns the trainer's version of the push it just received "
            "(model_version): the push's weights are published under it",
        ),
        Internal(
            "RayWeightSyncScheme.send, wrapped, and RayWeightSyncScheme._set_model_version",
            "0.14",
            "the trainer's push count, carried to each actor as TorchRL's model_version",
        ),
        Internal(
            "DistributedWeightSyncScheme.send, wrapped; ._store, ._store_info, ._worker_idx, ._model_id",
            "0.14",
            "TorchRL's distributed push carries no version: the trainer writes its push count into the "
            "TCPStore the scheme already uses, and a node reads it through a connection of its own",
        ),
        Internal(
            "Distributed(Sync)Collector._make_container, wrapped, and its receive buffers",
            "0.14",
            "the trainer's receive buffers (._tensordict_out, ._single_tds, ._tensordict_out_unbind) get the "
            "version keys the nodes' batches carry, and a memory per node; the trainer waits until every node's "
            "store exists (.collector_kwargs, .jobs)",
        ),
        Internal(
            "Trainer._optim_count",
            "0.11-0.14",
            "the optimizer-step count, for intervals and versions in optimizer steps",
        ),
        Internal(
            "UpdateWeights.counter, ._last_update_count",
            "0.11-0.14",
            "shmsync's UpdateWeights is TorchRL's, with versions: it keeps the same interval state",
        ),
    )
}

_checked: set[str] = set()


def changed(name: str, detail: str) -> TorchRLChangedError:
    """The error for internal ``name`` found otherwise than expected (``detail`` says how)."""
    known = INTERNALS[name]
    return TorchRLChangedError(
        f"TorchRL internal {name!r} (checked on torchrl {known.versions}; used for: {known.why}) is not as shmsync "
        f"expects in the installed torchrl {torchrl.__version__}: {detail}. shmsync supports torchrl "
        f"{_minor(SUPPORTED[0])} to {_minor(SUPPORTED[1])}"
    )


def check(name: str, ok: bool, detail: str) -> None:
    """Raise :func:`changed` unless ``ok``; checked once per process."""
    if name in _checked:
        return
    if not ok:
        raise changed(name, detail)
    _checked.add(name)


# -- collectors (main process) -------------------------------------------------------------------
def schemes_of(collector: Any) -> dict:
    """The collector's weight-sync schemes by key (``{}`` if it has none)."""
    name = "MultiCollector._weight_sync_schemes"
    schemes = getattr(collector, "_weight_sync_schemes", None)
    check(name, schemes is None or callable(getattr(schemes, "items", None)), f"it is a {type(schemes).__name__}")
    return dict(schemes.items()) if schemes is not None else {}


def replace_method(obj: Any, method: str, wrapper: Callable[[Callable], Callable], internal: str) -> bool:
    """Replace ``obj.method`` on the instance by ``wrapper(original)``; False if ``obj`` has none
    (a torchrl that lacks it: the caller does without)."""
    original = getattr(obj, method, None)
    if original is None:
        return False
    check(internal, callable(original), f"{type(obj).__name__}.{method} is not callable")
    setattr(obj, method, wrapper(original))
    return True


def caller_owning(predicate: Callable[[Any], bool], internal: str, depth: int = 12) -> Any:
    """The ``self`` of the nearest caller for which ``predicate(self)`` holds, or None."""
    check(internal, hasattr(sys, "_getframe"), "this Python has no sys._getframe")
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and predicate(owner):
            return owner
        frame = frame.f_back
    return None


def tracker_of(collector: Any) -> Any:
    """track_policy_version's tracker of ``collector``, or None."""
    tracker = getattr(collector, "policy_version_tracker", None)
    if tracker is not None:
        check(
            "BaseCollector.policy_version_tracker",
            hasattr(tracker, "version"),
            f"{type(tracker).__name__} has no version attribute",
        )
    return tracker


def receiver_schemes(collector: Any) -> dict:
    """The schemes ``collector`` receives the trainer's weights from (a node's, an actor's), or ``{}``."""
    schemes = getattr(collector, "_receiver_schemes", None)
    if schemes is None:
        return {}
    check("BaseCollector._receiver_schemes", isinstance(schemes, dict), f"it is a {type(schemes).__name__}")
    return schemes


def takes_received_version(collector: Any) -> bool:
    """Whether ``collector`` learns the trainer's version after a receive (torchrl >= 0.14)."""
    method = getattr(collector, "_set_received_policy_version", None)
    if method is None:
        return False
    params = list(inspect.signature(method).parameters)
    check(
        "BaseCollector._set_received_policy_version",
        params[:1] == ["model_version"],
        f"its parameters are {params}, not (model_version)",
    )
    return True


# -- the worker side ---------------------------------------------------------------------------
def worker_rollout(collector: Any) -> Callable:
    """The worker collector's ``rollout``, checked."""
    rollout = getattr(collector, "rollout", None)
    check(
        "Collector.rollout, shadowed on the worker's instance",
        callable(rollout) and isinstance(getattr(collector, "__dict__", None), dict),
        f"{type(collector).__name__} has no rollout method to poll before",
    )
    return rollout


def shadow_rollout(collector: Any, rollout: Callable) -> None:
    """Make ``rollout`` the worker collector's rollout, for this instance only."""
    collector.__dict__["rollout"] = rollout  # an instance attribute shadows the class's method


def worker_collector_on_stack() -> Any:
    """torchrl <= 0.12: the worker's collector, found among the callers of the receiver's first load."""
    return caller_owning(
        lambda owner: callable(getattr(owner, "rollout", None)) and callable(getattr(owner, "iterator", None)),
        "the call stack of the worker's Collector.__init__",
    )


HANDS_WORKERS_THEIR_COLLECTOR = TORCHRL_VERSION >= (0, 13)


# -- trainers and the hook -----------------------------------------------------------------------
def hook_takes_sender(hook_class: type) -> bool:
    """torchrl 0.14 added ``sender=`` and ``interval_unit=`` (optimizer-step intervals) to its hook."""
    return "sender" in inspect.signature(hook_class.__init__).parameters


def optimizer_step_count(trainer: Any) -> int:
    """The trainer's optimizer steps so far (the mixed-precision stepper's count if it has one)."""
    stepper = getattr(trainer, "optimization_stepper", None)
    count = getattr(stepper, "optimizer_step_count", None)
    if count is not None:
        return int(count)
    value = getattr(trainer, "_optim_count", None)
    check("Trainer._optim_count", isinstance(value, int), f"{type(trainer).__name__}._optim_count is {value!r}")
    return value


def check_hook_state(hook: Any) -> None:
    """TorchRL's hook keeps its interval state in ``counter`` (and, 0.14, ``_last_update_count``)."""
    check(
        "UpdateWeights.counter, ._last_update_count",
        isinstance(getattr(hook, "counter", None), int),
        "UpdateWeights has no counter",
    )


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
