"""The boundary between shmsync and TorchRL: every TorchRL internal shmsync relies on, and every
behaviour of TorchRL it counts on, reached through the functions of this module alone.

TorchRL's public extension points do most of the work: the ``WeightSyncScheme`` template methods
(``_init_on_sender_impl`` and the rest), its ``model``, ``context`` and ``model_id``, the backend
registry, the collectors' public methods and ``nn.Module`` hooks on the worker's policy. What they
do not cover is listed in :data:`CATALOGUE`: for each entry the torchrl minors it was checked on,
why no public path does the job, how it is checked, what happens if TorchRL moves it, and the
TorchRL extension point that would retire it.

Each entry is checked where it is used, every time (the checks are attribute lookups): a TorchRL
that renamed or removed it, or stopped behaving as relied on, gets a :class:`TorchRLChangedError`
naming the entry, the installed torchrl and the versions known to work, before a worker can run
stale weights. No other module of shmsync, ``shmsync.workers`` or ``hydra_plugins`` touches a
TorchRL private name (``tests/torchrl/test_compat.py`` parses the sources to make sure).

Nothing here changes TorchRL: the wrappers below are set on the instances of the collectors and
schemes a user hands a shmsync object to, never on TorchRL's classes or modules.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
import torchrl

from shmsync.errors import (
    ArgumentTypeError,
    InvalidArgumentError,
    MissingExtraError,
    ShmSyncError,
    UnknownAttributeError,
)
from shmsync.torchrl import releases

REFUSAL = releases.refusal(torchrl.__version__)
if REFUSAL is not None:
    raise MissingExtraError(REFUSAL)
# A nightly counts as the next minor; a torchrl with no minor was refused above.
TORCHRL_VERSION: tuple[int, int] = releases.minor(torchrl.__version__) or (0, 0)
SUPPORTED = releases.SUPPORTED  # the minors the gate lets in, first and last
NEWEST_RELEASE = releases.NEWEST_RELEASE  # the newest released minor (the main tier's)


def _minor(v: tuple[int, int]) -> str:
    return ".".join(map(str, v))


class TorchRLChangedError(ShmSyncError):
    """A TorchRL internal shmsync relies on is missing or has another shape in the installed
    torchrl, or TorchRL no longer behaves as shmsync relies on: shmsync stops rather than sync
    weights on a guess. The message names the entry of the catalogue (see the docs' TorchRL page)."""


@dataclass(frozen=True)
class Internal:
    """One entry of the catalogue: a TorchRL internal or behaviour shmsync relies on."""

    name: str
    versions: str
    why: str
    check: str
    moved: str
    upstream: str


# Entry names, as errors, tests and the docs name them.
SCHEMES = "BaseCollector._weight_sync_schemes"
METHODS = (
    "MultiCollector.update_policy_weights_ / shutdown / state_dict / load_state_dict / iterator, "
    "wrapped on the instance"
)
CONNECT = "WeightSyncScheme.initialized_on_sender, asked by the collector before init_on_sender(context=...)"
NEXT_BATCH = "MultiSyncCollector's next batch runs the weights update_policy_weights_() sent"
WORKERS_SET_UP = "WeightSyncScheme.init_on_receiver and connect, in every worker"
ROLLOUT = "Collector.rollout, shadowed on the worker's instance"
TRACKER = "BaseCollector.policy_version_tracker"
ACKNOWLEDGED = "MultiCollector._acknowledged_policy_version, behind policy_version (torchrl 0.15)"
WORKER_VERSIONS = "MultiCollector.worker_policy_versions (torchrl 0.15), wrapped on the instance"
OPTIM_COUNT = "Trainer._optim_count"
TRAINER_MODULES = "Trainer._modules"
CONTAINER = "Distributed(Sync)Collector._tensordict_out, the trainer's receive buffers"
DIST_STORE = "DistributedWeightSyncScheme._store / ._store_info"
DIST_PUSH = "DistributedWeightSyncScheme.send, wrapped on the trainer's instances"
NODES_START = "Distributed(Sync)Collector._init_workers, wrapped on the instance"
NODES = "Distributed(Sync)Collector.jobs"
DIST_LEAVES = (
    "DistributedTransport.send_weights_async / receive_weights (and their initial forms), wrapped on the instances"
)
DIST_NODE_TRANSPORT = "DistributedWeightSyncScheme.create_transport, set on the trainer's instance for the nodes"
RAY_PUSH = "RayCollector.update_policy_weights_ reaches each actor after the calls submitted before it"

CATALOGUE: dict[str, Internal] = {
    i.name: i
    for i in (
        Internal(
            SCHEMES,
            "0.11-0.14",
            "the collector's schemes by key, which TorchRL keeps in no public attribute: a collector's shmsync keys "
            "share one store (one update call is one version), and shmsync's distributed collectors find the "
            "trainer's schemes that push to the nodes",
            "the attribute exists on the collector and is None or a mapping",
            "TorchRLChangedError when the collector initializes the scheme, before any worker starts",
            "a public read-only `collector.weight_sync_schemes`",
        ),
        Internal(
            METHODS,
            "0.11-0.14",
            "public methods wrapped per collector: an update call publishes the shmsync keys it names straight "
            "into their stores as one version (under `version=` if given), as TorchRL documents `weights_dict` "
            "(atomic), without TorchRL's per-key loop; shutdown frees the stores; a read of the state dict "
            "publishes an update waiting for the hand-out first, and a restored one restores "
            "the workers' versions; each batch gets `('next', key)` where a worker could not tag it. Only the "
            "methods' public signatures are relied on",
            "the collector has the five methods and an instance dictionary, when the scheme meets it",
            "TorchRLChangedError then; if a wrapper is bypassed, TorchRL's loop calls `send()`, which publishes each "
            "key at once",
            "a scheme hook around one update call (`begin_update` / `end_update`) and a public version argument",
        ),
        Internal(
            CONNECT,
            "0.11-0.14",
            "a scheme initialized before its collector (`init_on_sender(model=...)`) is handed no collector when "
            "TorchRL connects it: it reports `initialized_on_sender` False until one hands itself over, and the "
            "collector initializes every scheme that reports so with `context=collector` before connecting it",
            "at `connect()`, a collector handed itself over",
            "TorchRLChangedError at `connect()`, before the first batch",
            "`connect()` (or `init_on_sender`) handing every scheme its collector as `context`",
        ),
        Internal(
            NEXT_BATCH,
            "0.11-0.14",
            "`MultiSyncCollector` (`MultiSyncDataCollector` before 0.13) sends its workers the word for their next "
            "batch after `update_policy_weights_()` returns, and that batch runs the weights sent: its workers wait at "
            "the start of a rollout for a version the trainer promised (a copy still in flight). Found by its class",
            "the collector is an instance of that class (no attribute is relied on)",
            "a renamed class: the workers run the newest version that landed, each frame tagged with it",
            "a collector attribute saying whether its next batch runs the weights just sent",
        ),
        Internal(
            WORKERS_SET_UP,
            "0.11-0.14",
            "TorchRL sets the scheme up in each worker; a worker it skipped would run its first weights forever",
            "at the first update, every worker's reader attached to the store (waiting a little for late ones)",
            "TorchRLChangedError at the first update",
            "none needed: a worker-side `connect()` that TorchRL documents as always called",
        ),
        Internal(
            ROLLOUT,
            "0.11-0.14",
            "polls before each rollout, so that a batch runs one version when the trainer published between batches, "
            "and tags `('next', key)`. A `pre_collect_hook` would do the first, but users may reassign theirs",
            "at the worker's start, its collector has a callable `rollout` and an instance dictionary",
            "missing, or called another way: the policy's own check loads every version at every call, and the "
            "trainer fills `('next', key)` from each frame's tag",
            "a list of per-rollout hooks on the worker's collector, or the scheme told of each rollout",
        ),
        Internal(
            TRACKER,
            "0.11-0.14",
            "`track_policy_version`'s transform: its version is set to the version loaded (workers) or published "
            "(trainer), so that `get_policy_version()` and `state_dict()` report the version the workers run",
            "the attribute exists on the collector and is None or has a `version`",
            "TorchRLChangedError at the trainer's start, or at the worker's start",
            "a public `collector.set_policy_version(v)`",
        ),
        Internal(
            ACKNOWLEDGED,
            "0.15 (nightly)",
            "0.15's `policy_version` / `get_policy_version()` report the version every worker acknowledged, which "
            "TorchRL advances in the `update_policy_weights_` shmsync's wrapper replaces: it is set to the version "
            "sent where the collector's next batch runs it on every worker (MultiSyncCollector), to None (no single "
            "version describes every worker, as TorchRL has it) after an asynchronous or partial update",
            "from 0.15 on, the collector has the attribute once built",
            "TorchRLChangedError at the trainer's start",
            "a public `collector.set_policy_version(v)` that keeps the aggregate",
        ),
        Internal(
            WORKER_VERSIONS,
            "0.15 (nightly)",
            "each worker's loaded version, answered from the readers' table instead of TorchRL's round of messages, "
            "which pauses asynchronous collection and waits for every worker (a frozen one too)",
            "where the collector has the method, it is callable",
            "TorchRLChangedError at the trainer's start",
            "a scheme hook: `WeightSyncScheme.worker_versions()`, asked before the workers are",
        ),
        Internal(
            OPTIM_COUNT,
            "0.11-0.14",
            "the optimizer-step count, for intervals and versions in optimizer steps (TorchRL's own hook reads it)",
            "it is an int at each use",
            "TorchRLChangedError at the hook's first call",
            "a public `trainer.optim_steps`",
        ),
        Internal(
            TRAINER_MODULES,
            "0.11-0.14",
            "modules added with `Trainer.register_module`, which paths such as `'replay_buffer'` name",
            "it is a mapping when a path needs it",
            "TorchRLChangedError naming the path",
            "a public `trainer.get_module(name)`",
        ),
        Internal(
            CONTAINER,
            "0.14",
            "the trainer receives each node's batch into buffers shaped like a batch of a single-process probe "
            "collector, which has no version keys (gloo aborts on the mismatch), and DistributedSyncCollector's "
            "nodes share one buffer memory: shmsync's subclasses add the keys and give each node memory of its own",
            "right after TorchRL's constructor built them: `_tensordict_out` exists, with `_single_tds` "
            "(DistributedSyncCollector), `_tensordict_out_unbind` (a lazy stack) or as a list of buffers",
            "TorchRLChangedError right after construction, the nodes shut down; how TorchRL builds them "
            "(`_make_container`) is not relied on",
            "a public way to add keys to the receive spec, and one buffer per node",
        ),
        Internal(
            DIST_STORE,
            "0.14",
            "TorchRL's distributed push carries no version: the trainer writes its push count into the TCPStore the "
            "push already uses, and each node reads it and confirms what it published",
            "`_store` is a `torch.distributed.Store` and `_store_info` has a host and a port (trainer)",
            "TorchRLChangedError at the first push, or the node's report of it at that push",
            "a `model_version` carried with each push, as the Ray scheme does",
        ),
        Internal(
            DIST_PUSH,
            "0.14",
            "every push of shmsync's distributed collectors goes through `send()` of the trainer's scheme, and each "
            "node's collector is told of it (`update_policy_weights_`) before the node acknowledges it",
            "after each push, every node it reached confirmed the push's version; every batch, no node reported a "
            "push it could not number",
            "TorchRLChangedError at that push or at the next batch",
            "a `model_version` carried with each push",
        ),
        Internal(
            NODES_START,
            "0.14",
            "the nodes start in `_init_workers`, right after the trainer's push schemes made their TCPStore: "
            "wrapped on the collector's instance, it hands the local schemes the store's address before they travel "
            "to the nodes, which read each push's number there",
            "the method exists when the collector is made, and when it runs the push schemes have an address",
            "TorchRLChangedError before any node starts",
            "a `model_version` carried with each push (no address needed)",
        ),
        Internal(
            NODES,
            "0.14",
            "the node processes, so that waiting for the nodes' stores ends as soon as a node died",
            "a list of objects with `is_alive()` (or absent: the wait then ends at its deadline)",
            "the wait ends at its deadline (60 s) with a named error",
            "a public liveness check of the nodes",
        ),
        Internal(
            DIST_LEAVES,
            "0.14",
            "TorchRL pushes the whole TensorDict to every node (`TensorDict.send`: a point-to-point message per "
            "leaf, in sorted key order; the node's `recv` into a buffer of the same keys): each node is sent the "
            "leaves that changed since the version it holds, as a TensorDict of those leaves on both ends, the "
            "list written into the push's TCPStore first",
            "the trainer's transports are `sender_transports` by worker index (rank = index + 1), each with the four "
            "methods; a node's transport is made with `store=`, `rank=`, `weights_buffer=`; each receive's leaf list "
            "is checked against the node's buffer and the version it holds",
            "TorchRLChangedError before any node starts (the trainer) or when the node's transport is made; a push "
            "that goes around the wrappers sends the whole weights, and the node, finding no list, receives them all",
            "a `weights` subset argument on the transport's send and receive (or deltas in TorchRL's scheme)",
        ),
        Internal(
            DIST_NODE_TRANSPORT,
            "0.14",
            "the node's receiving transport is made by the scheme object that travels to the node (pickled or "
            "forked), through `create_transport(**kwargs)`: shmsync's, set on that instance, makes TorchRL's public "
            "`DistributedTransport` and wraps its receive",
            "the scheme has `create_transport` when the nodes are about to start; the kwargs it is called with",
            "TorchRLChangedError in the node (answered to the trainer at the first push)",
            "a public transport factory argument on the scheme",
        ),
        Internal(
            RAY_PUSH,
            "0.14",
            "each push names its version to the actors it reaches in a call of shmsync's own submitted just before "
            "(`__ray_call__`), which Ray runs first; the actor's collector is told of the push "
            "(`update_policy_weights_`) within TorchRL's call",
            "after each push, every actor it reached confirmed the push's version",
            "TorchRLChangedError at that push",
            "`model_version` passed to the actor collector's `update_policy_weights_` with the push's weights",
        ),
    )
}


def changed(name: str, detail: str) -> TorchRLChangedError:
    """The error for catalogue entry ``name`` found otherwise than expected (``detail`` says how)."""
    entry = CATALOGUE[name]
    return TorchRLChangedError(
        f'TorchRL internal "{name}" (checked on torchrl {entry.versions}; used for: {entry.why}) is not as shmsync '
        f"expects in the installed torchrl {torchrl.__version__}: {detail}. shmsync supports torchrl "
        f"{_minor(SUPPORTED[0])} to {_minor(SUPPORTED[1])}"
    )


def check(name: str, ok: bool, detail: str) -> None:
    """Raise :func:`changed` unless ``ok``."""
    if not ok:
        raise changed(name, detail)


# -- the collector's schemes and methods (trainer side) -------------------------------------------
def schemes_of(collector: Any) -> dict[str, Any]:
    """The collector's weight-sync schemes by key (``{}`` if it has none)."""
    check(SCHEMES, hasattr(collector, "_weight_sync_schemes"), f"{type(collector).__name__} has no such attribute")
    schemes = collector._weight_sync_schemes
    check(SCHEMES, schemes is None or isinstance(schemes, Mapping), f"it is a {type(schemes).__name__}")
    return dict(schemes) if schemes is not None else {}


def wrap_on_instance(obj: Any, method: str, wrapper: Callable[[Callable], Callable], entry: str = METHODS) -> None:
    """Make ``wrapper(obj.method)`` the method of this one instance (an instance attribute
    shadows the class's method; TorchRL's class is left alone)."""
    original = getattr(obj, method, None)
    check(entry, callable(original), f"{type(obj).__name__}.{method} is missing or not callable")
    setattr(obj, method, wrapper(cast(Callable, original)))


def check_collector_handed_over(handed_over: bool) -> None:
    """At ``connect()`` of a scheme initialized before any collector: a collector handed itself over."""
    check(
        CONNECT,
        handed_over,
        "connect() was called, but no collector initialized the scheme with context= first",
    )


def runs_sent_weights_next(collector: Any) -> bool:
    """Whether ``collector``'s next batch runs the weights ``update_policy_weights_()`` just sent
    (a synchronous multi-process collector), so that its workers wait for a promised version."""
    import torchrl.collectors as collectors

    sync = tuple(
        c for c in (getattr(collectors, n, None) for n in ("MultiSyncCollector", "MultiSyncDataCollector")) if c
    )
    check(NEXT_BATCH, bool(sync), "torchrl.collectors has neither MultiSyncCollector nor MultiSyncDataCollector")
    return isinstance(collector, sync)


def update_request(args: tuple, kwargs: dict) -> tuple[dict[str, Any], Any]:
    """What an ``update_policy_weights_(*args, **kwargs)`` call asks for, as TorchRL's public
    signature resolves it: ``({key: weights or None}, worker_ids)`` (``weights_dict``, else
    ``{model_id or "policy": policy_or_weights / weights= / policy=}``).

    Raises:
        ValueError: conflicting arguments, as TorchRL refuses them.
    """
    if len(args) > 1:
        raise ArgumentTypeError(f"update_policy_weights_() takes at most one positional argument, got {len(args)}")
    given = {k: kwargs.get(k) for k in ("weights", "policy")}
    weights = args[0] if args else kwargs.get("policy_or_weights")
    for name, value in given.items():
        if value is not None:
            if weights is not None:
                raise InvalidArgumentError(f"Cannot specify both positional 'policy_or_weights' and keyword '{name}'")
            weights = value
    weights_dict, model_id = kwargs.get("weights_dict"), kwargs.get("model_id")
    if weights_dict is not None:
        if model_id is not None:
            raise InvalidArgumentError("Cannot specify both 'weights_dict' and 'model_id'")
        if weights is not None:
            raise InvalidArgumentError("Cannot specify both 'weights_dict' and 'policy_or_weights'")
        if not isinstance(weights_dict, Mapping):
            raise ArgumentTypeError(
                f"weights_dict must be a mapping of model ids to weights, got {type(weights_dict).__name__}"
            )
        return {str(k): v for k, v in weights_dict.items()}, kwargs.get("worker_ids")
    return {model_id or "policy": weights}, kwargs.get("worker_ids")


def check_workers_set_up(attached: int, expected: int, store_name: str) -> None:
    check(
        WORKERS_SET_UP,
        attached >= expected,
        f"only {attached} of the {expected} worker readers attached to store {store_name!r}: TorchRL did not set "
        "the scheme up in every worker, which would then run its first weights forever",
    )


# -- the worker's collector -----------------------------------------------------------------------
def worker_rollout(collector: Any) -> Callable | None:
    """The worker collector's ``rollout``, if it has one that an instance attribute can shadow
    (without, the worker does without the shadow: its policy checks at every call)."""
    rollout = getattr(collector, "rollout", None)
    if callable(rollout) and isinstance(getattr(collector, "__dict__", None), dict):
        return rollout
    return None


def shadowed_rollout(collector: Any) -> Any:
    """What shadows the worker collector's ``rollout`` on its instance, or None."""
    instance = getattr(collector, "__dict__", None)
    return instance.get("rollout") if isinstance(instance, dict) else None


def shadow_rollout(collector: Any, rollout: Callable) -> None:
    """Make ``rollout`` the worker collector's rollout, for this instance only."""
    instance = getattr(collector, "__dict__", None)
    check(ROLLOUT, isinstance(instance, dict), f"{type(collector).__name__} has no instance dictionary")
    cast(dict, instance)["rollout"] = rollout


def tracker_of(collector: Any) -> Any:
    """``track_policy_version``'s tracker of a TorchRL collector, or None if it tracks none."""
    check(TRACKER, hasattr(collector, "policy_version_tracker"), f"{type(collector).__name__} has no such attribute")
    tracker = collector.policy_version_tracker
    check(TRACKER, tracker is None or hasattr(tracker, "version"), f"{type(tracker).__name__} has no version attribute")
    return tracker


def version_setter(collector: Any) -> Callable[[list[int]], None] | None:
    """What makes ``collector``'s ``track_policy_version`` tracker report the versions just sent
    (one per store; checked now), or None if it tracks none. From torchrl 0.15 on, it also sets the
    version every worker acknowledged (``policy_version``): the one sent where the next batch runs
    it on every worker, else None."""
    tracker = tracker_of(collector)
    if tracker is None:
        return None
    aggregate = TORCHRL_VERSION >= (0, 15)
    check(ACKNOWLEDGED, not aggregate or "_acknowledged_policy_version" in vars(collector), "the attribute is missing")
    exact = runs_sent_weights_next(collector)

    def report(versions: list[int]) -> None:
        tracker.version = max(versions)
        if aggregate:
            every_worker = exact and len(set(versions)) == 1
            collector._acknowledged_policy_version = versions[0] if every_worker else None

    return report


def has_worker_versions(collector: Any) -> bool:
    """Whether ``collector`` answers a per-worker version query (torchrl 0.15's, checked now)."""
    if TORCHRL_VERSION < (0, 15):
        return False
    check(WORKER_VERSIONS, callable(getattr(collector, "worker_policy_versions", None)), "the method is missing")
    return True


def set_policy_version(collector: Any, version: int, *, built: bool = True) -> None:
    """Make ``track_policy_version``'s tracker of ``collector`` (if it tracks) report ``version``.
    ``built=False``: the collector may still be in its constructor (a worker's first load), and
    may not have its tracker yet."""
    if not built and not hasattr(collector, "policy_version_tracker"):
        return
    tracker = tracker_of(collector)
    if tracker is not None and tracker.version != version:
        tracker.version = version


# -- trainers and the hook ------------------------------------------------------------------------
def hook_takes_sender(hook_class: type) -> bool:
    """torchrl 0.14 added ``sender=`` and ``interval_unit=`` to its hook."""
    return "sender" in inspect.signature(hook_class).parameters


def optimizer_step_count(trainer: Any) -> int:
    """The trainer's optimizer steps so far (the mixed-precision stepper's count if it has one)."""
    stepper = getattr(trainer, "optimization_stepper", None)
    count = getattr(stepper, "optimizer_step_count", None)
    if count is not None:
        return int(count)
    value = getattr(trainer, "_optim_count", None)
    check(OPTIM_COUNT, isinstance(value, int), f"{type(trainer).__name__}._optim_count is {value!r}")
    return cast(int, value)


def registered_module(trainer: Any, name: str) -> Any:
    """The module ``trainer.register_module(name, ...)`` added; AttributeError if there is none."""
    from torchrl.trainers import Trainer

    modules = getattr(trainer, "_modules", None)
    if modules is None and not isinstance(trainer, Trainer):
        raise UnknownAttributeError(name)
    check(TRAINER_MODULES, isinstance(modules, Mapping), f"{type(trainer).__name__}._modules is {modules!r}")
    registered = cast(Mapping, modules)
    if name not in registered:
        raise UnknownAttributeError(name)
    return registered[name]


def check_hook_arguments(
    collector, update_weights_interval, policy_weights_getter, weight_update_map, trainer, sender, interval_unit
) -> None:
    """torchrl 0.14's validation of its hook's arguments, for a torchrl whose hook lacks them."""
    if update_weights_interval < 1:
        raise InvalidArgumentError("update_weights_interval must be >= 1")
    if interval_unit not in ("batches", "optim_steps"):
        raise InvalidArgumentError(f"interval_unit must be 'batches' or 'optim_steps', got {interval_unit!r}")
    if sender is None and collector is None:
        raise InvalidArgumentError("either a collector or a sender must be provided")
    if sender is not None and (policy_weights_getter is not None or weight_update_map is not None):
        raise InvalidArgumentError("sender is mutually exclusive with policy_weights_getter and weight_update_map")
    if weight_update_map is not None and trainer is None:
        raise InvalidArgumentError("trainer must be provided when using weight_update_map")
    if interval_unit == "optim_steps" and trainer is None:
        raise InvalidArgumentError("trainer must be provided when interval_unit='optim_steps'")


# -- distributed collectors (torchrl >= 0.14) -----------------------------------------------------


def extend_receive_buffers(collector: Any, add: Callable[[Any], None]) -> None:
    """Apply ``add`` to each node's receive buffer of a distributed collector (to give it the
    version keys the nodes' batches carry), leaving them locked as TorchRL left them; for
    DistributedSyncCollector, first give each node memory of its own."""
    check(
        CONTAINER,
        hasattr(collector, "_tensordict_out"),
        f"{type(collector).__name__} has no _tensordict_out receive buffer",
    )
    if hasattr(collector, "_single_tds"):  # DistributedSyncCollector: one buffer, viewed per node
        # TorchRL expands one probe batch, so every node's view is the same memory (stride 0) and
        # the nodes' batches overwrite each other: a frame's tag could come from one node and its
        # data from the other. Each node gets memory of its own.
        out = collector._tensordict_out.clone()
        add(out)
        collector._tensordict_out = out.lock_()
        collector._single_tds = out.unbind(0)
    elif hasattr(collector, "_tensordict_out_unbind"):  # DistributedCollector(sync=True): a lazy stack
        root = collector._tensordict_out.unlock_()
        for td in collector._tensordict_out_unbind:
            add(td.unlock_())
        root.lock_()
        for td in collector._tensordict_out_unbind:
            td.lock_()
    else:  # DistributedCollector(sync=False): one buffer per node
        buffers = collector._tensordict_out
        check(CONTAINER, isinstance(buffers, (list, tuple)), f"_tensordict_out is a {type(buffers).__name__}")
        for td in buffers:
            add(td.unlock_())
            td.lock_()


def push_store(scheme: Any) -> torch.distributed.Store:
    """The TCPStore the trainer's distributed scheme pushes through."""
    store = getattr(scheme, "_store", None)
    check(
        DIST_STORE,
        isinstance(store, torch.distributed.Store),
        f"{type(scheme).__name__}._store is a {type(store).__name__}",
    )
    return cast(torch.distributed.Store, store)


def push_address(scheme: Any) -> tuple[str, int]:
    """Where the TCPStore of the trainer's distributed push scheme ``scheme`` listens."""
    info = getattr(scheme, "_store_info", None)
    ok = isinstance(info, Mapping) and "host" in info and "port" in info
    check(DIST_STORE, ok, f"{type(scheme).__name__}._store_info is {info!r}")
    where = cast(Mapping, info)
    return str(where["host"]), int(where["port"])


def before_nodes_start(collector: Any, then: Callable[[], None]) -> None:
    """Run ``then()`` right before ``collector`` (a distributed collector being built) starts its
    nodes: after its push schemes made their TCPStore, before anything travels to a node."""
    check(NODES_START, callable(getattr(type(collector), "_init_workers", None)), "it has no _init_workers")

    def start_nodes(original: Callable) -> Callable:
        def run(*args: Any, **kwargs: Any) -> Any:
            then()
            return original(*args, **kwargs)

        return run

    wrap_on_instance(collector, "_init_workers", start_nodes, NODES_START)


def wrap_push(scheme: Any, wrapper: Callable[[Callable], Callable]) -> None:
    """Wrap ``send`` of one trainer-side distributed scheme instance (shmsync's collector's own)."""
    wrap_on_instance(scheme, "send", wrapper, DIST_PUSH)


def check_push_confirmed(problems: list[str]) -> None:
    check(DIST_PUSH, not problems, "; ".join(problems))


def node_processes(collector: Any) -> list[Any] | None:
    """The node processes of a distributed collector (``launcher="mp"``), or None if TorchRL keeps
    none (another launcher, or a torchrl that renamed them: waits then end at their deadlines)."""
    jobs = getattr(collector, "jobs", None)
    if jobs is None or not all(callable(getattr(j, "is_alive", None)) for j in jobs or ()):
        return None
    check(NODES, isinstance(jobs, (list, tuple)), f"{type(collector).__name__}.jobs is a {type(jobs).__name__}")
    return list(jobs)


def sender_transports(scheme: Any) -> dict[int, Any]:
    """The trainer's transports of a distributed push scheme, by rank (TorchRL's worker index + 1)."""
    transports = getattr(scheme, "sender_transports", None)
    check(DIST_LEAVES, isinstance(transports, Mapping), f"{type(scheme).__name__}.sender_transports is {transports!r}")
    out = {}
    for index, transport in cast(Mapping, transports).items():
        check(DIST_LEAVES, isinstance(index, int), f"a transport is registered under {index!r}, not a worker index")
        for method in ("send_weights_async", "send_initial_weights"):
            check(DIST_LEAVES, callable(getattr(transport, method, None)), f"{type(transport).__name__}.{method}")
        out[index + 1] = transport
    return out


def set_node_transports(scheme: Any, make: Callable[..., Any]) -> None:
    """Have the nodes' copies of ``scheme`` make their receiving transport with ``make(**kwargs)``."""
    check(DIST_NODE_TRANSPORT, callable(getattr(scheme, "create_transport", None)), "it has no create_transport")
    scheme.create_transport = make


def node_transport(kwargs: dict[str, Any]) -> tuple[Any, torch.distributed.Store, int, Any]:
    """A node's receiving transport, made as TorchRL makes it (``DistributedTransport(**kwargs)``),
    with the store, rank and receive buffer TorchRL gave it."""
    from tensordict import TensorDictBase
    from torchrl.weight_update import DistributedTransport

    store, rank, buffer = kwargs.get("store"), kwargs.get("rank"), kwargs.get("weights_buffer")
    ok = isinstance(store, torch.distributed.Store) and isinstance(rank, int) and isinstance(buffer, TensorDictBase)
    check(DIST_NODE_TRANSPORT, ok, f"create_transport was called with {sorted(kwargs)}")
    transport = DistributedTransport(**kwargs)
    for method in ("receive_weights", "receive_initial_weights"):
        check(DIST_LEAVES, callable(getattr(transport, method, None)), f"DistributedTransport.{method}")
    return transport, cast(torch.distributed.Store, store), cast(int, rank), buffer


# -- Ray --------------------------------------------------------------------------------------------
def check_ray_push_confirmed(problems: list[str]) -> None:
    check(RAY_PUSH, not problems, "; ".join(problems))
