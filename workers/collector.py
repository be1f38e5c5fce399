"""One rollout worker process: attach to a store by name, collect, reload lazily, hand batches back.

A worker exits within about a second when its parent dies, and on SIGTERM finishes the
rollout it is in and exits cleanly.
"""

from __future__ import annotations

import importlib
import pickle
import queue as queue_module
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from shmsync.errors import InvalidArgumentError


@dataclass
class WorkerConfig:
    store: str  # name of the trainer's WeightStore
    env: str = "CartPole-v1"
    device: str = "cpu"  # where the policy runs: "cpu" or "cuda:N"
    frames_per_batch: int = 200
    policy: str = "shmsync.workers.policies:mlp_policy"  # "module:function(env) -> module"
    destination: str | None = None  # for a store holding several destinations
    seed: int = 0
    version_key: str = "policy_version"
    zero_copy: bool | None = None  # CPU policies run on the store in place unless False (see WeightReader)


def load_object(path: str) -> Any:
    """``"package.module:name"`` -> the object."""
    module, _, name = path.partition(":")
    if not name:
        raise InvalidArgumentError(f"expected 'module:function', got {path!r}")
    return getattr(importlib.import_module(module), name)


def run_worker(worker_id: int, config: WorkerConfig, queue: Any, parent_pid: int) -> None:
    """Entry point of a worker process (see :func:`shmsync.workers.launch.launch`).

    Puts ``("started", worker_id, None)`` once SIGTERM stops it cleanly, ``("batch", worker_id,
    batch)`` on ``queue`` for every rollout, then
    ``("exit", worker_id, reloads)`` when it stops; if it fails, ``("error", worker_id,
    exception)`` first, so the pool can raise the worker's own error at once.
    """
    from shmsync import exit_with_parent

    exit_with_parent(parent_pid)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    queue.put(("started", worker_id, None))  # from now on a SIGTERM stops it cleanly
    torch.set_num_threads(1)
    try:
        _collect(worker_id, config, queue, stopping)
    except BaseException as e:
        queue.put(("error", worker_id, _portable(e)))
        # Reported, with its traceback, to the pool, which raises it: not printed a second time
        # here (the exit code is what an uncaught error would give).
        raise SystemExit(130 if isinstance(e, KeyboardInterrupt) else 1) from None


def _collect(worker_id: int, config: WorkerConfig, queue: Any, stopping: threading.Event) -> None:
    from torchrl.collectors import Collector

    from shmsync import WeightReader, WeightStore
    from shmsync.watch.frames import tag_versions

    store = WeightStore.attach(config.store)
    try:
        factory = load_object(config.policy)
        env_fn = _EnvFactory(config.env)
        env = env_fn()
        with torch.device("meta"):
            policy = factory(env)  # no memory for weights until the first load
        env.close()
        reader = WeightReader(
            store,
            policy,
            device=config.device,
            destination=config.destination,
            zero_copy=config.zero_copy if torch.device(config.device).type == "cpu" else False,
            worker=worker_id,
        )
    except BaseException:
        store.close()
        raise
    reader.poll()
    # A lazy reload at every policy call (a version check when nothing changed): the public
    # nn.Module hook works whatever path the collector of any torchrl minor takes to the policy.
    policy.register_forward_pre_hook(_poll_before_each_call(reader))
    tag_versions(policy, lambda: reader.version, config.version_key)
    options = {"auto_register_policy_transforms": False} if _takes(Collector, "auto_register_policy_transforms") else {}
    collector = Collector(
        env_fn,
        policy,
        frames_per_batch=config.frames_per_batch,
        total_frames=-1,
        policy_device=config.device,
        env_device="cpu",
        storing_device="cpu",
        **options,
    )
    collector.set_seed(config.seed + worker_id)
    try:
        for batch in collector:
            reader.set_waiting(True)  # the readers' table: waiting for the trainer, not running weights
            while True:  # don't block forever on a full queue: SIGTERM must still be seen
                try:
                    queue.put(("batch", worker_id, batch), timeout=0.5)
                    break
                except queue_module.Full:
                    if stopping.is_set():
                        break
            reader.poll()  # before it runs again: never seen running at the old version
            reader.set_waiting(False)
            if stopping.is_set():
                break
    finally:
        collector.shutdown()
        queue.put(("exit", worker_id, reader.reloads))
        reader.close()
        store.close()


def _poll_before_each_call(reader: Any):
    def hook(module, args) -> None:  # a pre-hook returning a value would replace the policy's input
        reader.poll()

    return hook


def _takes(cls: type, parameter: str) -> bool:
    """Whether ``cls`` takes ``parameter`` (torchrl 0.13 added auto_register_policy_transforms)."""
    import inspect

    return parameter in inspect.signature(cls).parameters


def _portable(error: BaseException) -> BaseException:
    """``error`` as it can cross to the parent: itself if it pickles, else a RuntimeError saying
    what it was; with the worker's traceback attached as a note."""
    text = "".join(traceback.format_exception(error)).rstrip()
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        error = RuntimeError(f"{type(error).__name__}: {error}")
    note = f"in the worker process:\n{text}"
    if sys.version_info >= (3, 11):
        error.add_note(note)
    else:  # Python 3.10 has no add_note: the same list, which its tracebacks do not print
        error.__notes__ = [*getattr(error, "__notes__", []), note]  # type: ignore[attr-defined]  # 3.11+ in typeshed
    return error


class _EnvFactory:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self):
        from shmsync.workers.policies import make_env

        return make_env(self.name)
