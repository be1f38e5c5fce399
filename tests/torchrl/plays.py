"""Plays of a TorchRL release that changed (``tests/torchrl/test_compat.py``): a real collector
through four or more publishes, in a session whose TorchRL ``torchrl_edits`` rewrote; each ends
with every frame on the version published before its batch, or a ``TorchRLChangedError`` naming
the entry, reported as one ``RESULT`` line."""

from __future__ import annotations

import os

import torch

from shmsync import WeightStore
from tests.torchrl.collectors import (
    free_ports,
    make_env,
    make_loss,
    make_marked_pendulum,
    make_pendulum,
    make_policy,
    make_probe_policy,
    make_trainer,
)
from tests.weights import fill


class WrongFrames(AssertionError):
    """A play saw frames that ran stale, mixed or mislabelled weights, or a wrong reported version."""


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise WrongFrames(what)


def check_tagged(batch, where: str = "") -> list[int]:
    """Every frame of ``batch`` ran one version, whole, tagged with it twice; the versions, sorted."""
    lo, hi = batch["w_lo"], batch["w_hi"]
    expect(torch.equal(lo, hi), f"{where}a frame ran a mix of two versions")
    for key in ("policy_version", ("next", "policy_version")):
        expect(key in batch.keys(True), f"{where}frames carry no {key!r}")
        expect(torch.equal(batch[key], lo.long()), f"{where}{key!r} is not the version whose weights acted")
    return sorted(set(lo.long().flatten().tolist()))


def check_batch(batch, version: int, where: str = "") -> None:
    """Every frame of ``batch`` ran version ``version``, whole, and is tagged with it twice."""
    lo, hi = batch["w_lo"], batch["w_hi"]
    expect(torch.equal(lo, hi), f"{where}a frame ran a mix of two versions")
    expect(bool((lo == version).all()), f"{where}frames ran {lo.unique().tolist()}, not version {version}")
    for key in ("policy_version", ("next", "policy_version")):
        expect(key in batch.keys(True), f"{where}frames carry no {key!r}")
        expect(bool((batch[key] == version).all()), f"{where}{key!r} is {batch[key].unique().tolist()}, not {version}")


def play_size() -> int:
    """Workers, nodes or actors a play runs: 2, or 1 for a play that must end in a named error
    (it ends at the first publish or before; ``SHMSYNC_PLAY_SMALL=1``)."""
    return 1 if os.environ.get("SHMSYNC_PLAY_SMALL") == "1" else 2


def play_multisync(preinitialized: bool = False, publishes: int = 4) -> None:
    """A MultiSyncCollector of 2 workers with track_policy_version: each publish before a batch is
    the version every frame of that batch runs and carries, and the version TorchRL reports."""
    from torchrl.collectors import MultiSyncCollector

    from shmsync import ShmWeightSyncScheme

    policy = make_probe_policy()
    fill(policy, 0)
    scheme = ShmWeightSyncScheme()
    workers = play_size()
    if preinitialized:
        scheme.init_on_sender(model=policy, devices=["cpu"] * workers)
    collector = MultiSyncCollector(
        [make_pendulum] * workers,
        policy,
        frames_per_batch=40,
        total_frames=-1,
        weight_sync_schemes={"policy": scheme},
        track_policy_version=True,
    )
    try:
        batches = iter(collector)
        for version in range(publishes + 1):
            if version:
                fill(policy, version)
                collector.update_policy_weights_()
            check_batch(next(batches), version, f"batch {version}: ")
            reported = collector.get_policy_version()
            expect(reported == version, f"get_policy_version() is {reported}, the workers run {version}")
        saved = collector.state_dict().get("policy_version")
        expect(saved in (None, publishes), f"state_dict()['policy_version'] is {saved}, not {publishes}")
    finally:
        collector.shutdown()


def play_multisync_preinitialized() -> None:
    play_multisync(preinitialized=True)


def play_hook() -> None:
    """shmsync's UpdateWeights on a real Trainer: a WeightSender publishes every 2 optimizer steps
    under the step count, through a path naming a module added with register_module."""
    from torchrl.collectors import Collector

    from shmsync import UpdateWeights, WeightSender

    policy = make_policy()
    collector = Collector(make_env, policy, frames_per_batch=20, total_frames=60)
    trainer = make_trainer(collector, make_loss(policy), total_frames=60, optim_steps_per_batch=2)
    trainer.register_module("acting", policy)
    store = WeightStore.create({"policy": policy})
    try:
        hook = UpdateWeights(
            update_weights_interval=2,
            trainer=trainer,
            sender=WeightSender(store, {"policy": "acting"}, root=trainer),
            interval_unit="optim_steps",
            versioning="optim_steps",
        )
        hook.register(trainer)
        trainer.train()
        expect(store.version == 6, f"the store holds version {store.version} after 6 optimizer steps, not 6")
        expect(hook.state_dict()["last_update_count"] == 6, f"the hook's state is {hook.state_dict()}")
    finally:
        store.close()
        collector.shutdown()


def play_distributed(name: str, pushes: int = 4) -> None:
    """shmsync's distributed collector ``name``: 2 nodes of 1 worker, a push before each batch;
    each batch's frames run and carry the trainer's number of the push before it."""
    import shmsync.torchrl.distributed as distributed
    from shmsync import ShmWeightSyncScheme

    policy = make_probe_policy()
    fill(policy, 0)
    nodes = play_size()
    collector = getattr(distributed, name)(
        [make_pendulum, make_marked_pendulum][:nodes],
        policy,
        collector_class=multisync(),
        num_workers_per_collector=1,
        frames_per_batch=20 * nodes,
        total_frames=20 * nodes * (pushes + 1),
        collector_kwargs={"weight_sync_schemes": {"policy": ShmWeightSyncScheme()}},
        launcher="mp",
        tcp_port=str(free_ports()),
        **({"sync": True} if name == "DistributedCollector" else {}),
    )
    try:
        if name == "DistributedSyncCollector":
            # It pushes before every batch (push i + 1, filled with i + 1), while its nodes collect
            # on their own: a node's batch runs the push it last applied, never an older one.
            fill(policy, 1)
            seen = {node: [0] for node in range(nodes)}
            for i, batch in enumerate(collector):
                for node in range(nodes):
                    versions = check_tagged(batch[node], f"batch {i}, node {node + 1}: ")
                    expect(versions[0] >= seen[node][-1] and versions[-1] <= i + 1, f"node {node + 1} ran {versions}")
                    seen[node] += versions
                fill(policy, i + 2)
            expect(min(v[-1] for v in seen.values()) >= pushes - 1, f"the nodes fell behind: {seen}")
        else:
            for i, batch in enumerate(collector):
                check_batch(batch, i, f"batch {i}: ")
                fill(policy, i + 1)
                collector.update_policy_weights_()
    finally:
        collector.shutdown()


def play_distributed_sync() -> None:
    play_distributed("DistributedSyncCollector")


def play_distributed_generic() -> None:
    play_distributed("DistributedCollector")


def play_ray(pushes: int = 4) -> None:
    """shmsync's RayCollector: 2 actors of 1 worker on a local cluster, a push to both before
    each batch; each batch's frames run and carry the trainer's number of that push."""
    import ray

    from shmsync import ShmWeightSyncScheme
    from shmsync.torchrl.distributed import RayCollector

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        policy = make_probe_policy()
        fill(policy, 0)
        actors = play_size()
        collector = RayCollector(
            [make_pendulum, make_marked_pendulum][:actors],
            policy,
            collector_class=multisync(),
            collector_kwargs={"num_workers": 1, "weight_sync_schemes": {"policy": ShmWeightSyncScheme()}},
            remote_configs={"num_cpus": 1},
            frames_per_batch=40 * actors,
            total_frames=40 * actors * (pushes + 1),
            sync=True,
        )
        try:
            for i, batch in enumerate(collector):
                check_batch(batch, i, f"batch {i}: ")
                fill(policy, i + 1)
                collector.update_policy_weights_(policy)
        finally:
            collector.shutdown()
    finally:
        ray.shutdown()


def multisync():
    from torchrl.collectors import MultiSyncCollector

    return MultiSyncCollector


def play(name: str) -> None:
    """Run play ``name`` in this process (one whose TorchRL tests/torchrl/torchrl_edits rewrote) and print
    its outcome as one line, ``RESULT {json}``: ok, named (a TorchRLChangedError naming an entry),
    wrong (frames or reported versions) or error (anything else)."""
    import json
    import re

    try:
        globals()[f"play_{name}"]()
        outcome = {"outcome": "ok"}
    except WrongFrames as e:
        outcome = {"outcome": "wrong", "detail": str(e)}
    except BaseException as e:  # the outcome is the report
        text = f"{type(e).__name__}: {e}"
        found = re.search(r'TorchRL internal "([^"]+)"', text)
        outcome = {"outcome": "named" if found else "error", "entry": found and found.group(1), "detail": text[-4000:]}
    print("RESULT " + json.dumps(outcome), flush=True)
