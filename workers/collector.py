"""One rollout worker process: attach to a store by name, collect, reload lazily, hand batches back.

A worker exits within about a second when its parent dies, and on SIGTERM finishes the
rollout it is in and exits cleanly.
"""

from __future__ import annotations

import importlib
import os
import queue as queue_module
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class WorkerConfig:
    store: str  # name of the trainer's WeightStore
    env: str = "CartPole-v1"
    device: str = "cpu"  # where the policy runs: "cpu" or "cuda:N"
    frames_per_batch: int = 200
    policy: str = "workers.policies:mlp_policy"  # "module:function(env) -> module"
    destination: str | None = None  # for a store holding several destinations
    seed: int = 0
    version_key: str = "policy_version"
    zero_copy: bool = False  # CPU policies: parameters view the store (see WeightReader)


def load_object(path: str) -> Any:
    """``"package.module:name"`` -> the object."""
    module, _, name = path.partition(":")
    if not name:
        raise ValueError(f"expected 'module:function', got {path!r}")
    return getattr(importlib.import_module(module), name)


def _exit_with_parent(parent: int, period: float = 0.2) -> None:
    """Daemon thread: leave as soon as the parent process is gone (we were re-parented)."""
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(period)


def run_worker(worker_id: int, config: WorkerConfig, queue: Any, parent_pid: int) -> None:
    """Entry point of a worker process (see :func:`workers.launch.launch`).

    Puts ``("batch", worker_id, batch)`` on ``queue`` for every rollout, then
    ``("exit", worker_id, reloads)`` when it stops.
    """
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    torch.set_num_threads(1)

    from torchrl.collectors import Collector

    from shmsync import WeightReader, WeightStore
    from shmsync.tagging import tag_versions

    store = WeightStore.attach(config.store)
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
        zero_copy=config.zero_copy and torch.device(config.device).type == "cpu",
    )
    reader.poll()
    tag_versions(policy, lambda: reader.version, config.version_key)
    collector = Collector(
        env_fn,
        policy,
        frames_per_batch=config.frames_per_batch,
        total_frames=-1,
        policy_device=config.device,
        env_device="cpu",
        storing_device="cpu",
        pre_collect_hook=reader.poll,  # lazy reload at the start of each rollout
        auto_register_policy_transforms=False,
    )
    collector.set_seed(config.seed + worker_id)
    try:
        for batch in collector:
            while True:  # don't block forever on a full queue: SIGTERM must still be seen
                try:
                    queue.put(("batch", worker_id, batch), timeout=0.5)
                    break
                except queue_module.Full:
                    if stopping.is_set():
                        break
            if stopping.is_set():
                break
    finally:
        collector.shutdown()
        queue.put(("exit", worker_id, reader.reloads))
        reader.close()
        store.close()


class _EnvFactory:
    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self):
        from workers.policies import make_env

        return make_env(self.name)
