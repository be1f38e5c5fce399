"""shmsync as each node's local scheme under TorchRL's distributed collectors (torch.distributed,
gloo, ``launcher="mp"``: every node is a process of this machine, as hosts would be)."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from shmsync import ShmWeightSyncScheme
from shmsync.torchrl.compat import TORCHRL_VERSION
from tests.torchrl.collectors import (
    free_ports,
    make_frozen_probe_policy,
    make_marked_pendulum,
    make_pendulum,
    make_probe_policy,
)
from tests.waiting import wait_for
from tests.weights import fill

# TorchRL's distributed collectors, on every minor (before 0.14 they must refuse shmsync's local leg).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.torchrl,
    pytest.mark.minors,
    pytest.mark.distributed,
    pytest.mark.timeout(240),
]
needs_0_14 = pytest.mark.skipif(TORCHRL_VERSION < (0, 14), reason="shmsync's local scheme needs torchrl >= 0.14")


def two_nodes_with_shmsync(name: str, policy, scheme=None, **kwargs):
    """shmsync's distributed collector ``name``: 2 nodes of 2 Pendulum workers each (node 2's
    observations shifted by +100, so a batch tells its node), shmsync as each node's local scheme.

    TorchRL's trainer waits at most 10 s for a node's answer in its TCPStore (hard-coded); a node
    shutting its workers down on a busy machine can take longer, so the store is given more."""
    from torchrl.collectors import MultiSyncCollector

    import shmsync.torchrl.distributed as distributed

    collector = getattr(distributed, name)(
        [make_pendulum, make_marked_pendulum],
        policy,
        collector_class=MultiSyncCollector,
        num_workers_per_collector=2,
        collector_kwargs={"weight_sync_schemes": {"policy": scheme or ShmWeightSyncScheme()}},
        launcher="mp",
        tcp_port=str(free_ports()),
        **kwargs,
    )
    store = getattr(collector, "_store", None)
    if isinstance(store, torch.distributed.Store):
        store.set_timeout(timedelta(seconds=120))
    return collector


def node_of(batch) -> int:
    """Which node (1 or 2) collected ``batch``: node 2's observations are shifted by +100."""
    return 2 if float(batch["observation"].mean()) > 50 else 1


def assert_tagged_with_the_weights_that_acted(batch) -> list[int]:
    """Every frame's version tag is the version whose weights (all filled with that number)
    produced it; returns the versions seen."""
    tags = batch["policy_version"]
    assert torch.equal(tags, batch["next", "policy_version"])
    assert torch.equal(batch["w_lo"], batch["w_hi"]), "a frame was produced by a mix of two versions"
    assert torch.equal(batch["w_lo"].long(), tags), "a frame is tagged with a version whose weights did not act"
    return sorted(set(tags.flatten().tolist()))


@needs_0_14
def test_distributed_sync_collector_with_shmsync_as_each_nodes_local_leg():
    policy = make_probe_policy()
    fill(policy, 0)  # the weights each node starts from: version 0
    scheme = ShmWeightSyncScheme()
    collector = two_nodes_with_shmsync(
        "DistributedSyncCollector", policy, scheme, frames_per_batch=128, total_frames=768
    )
    seen, batches = [], 0
    try:
        # Each batch starts with a push (update_interval=1): push n carries version n.
        fill(policy, 1)
        for i, batch in enumerate(collector):
            if i == 1:  # each node rewrites its readers' table about once a second
                wait_for(lambda: len(scheme.readers()) == 4, timeout=20, what="every node's workers in the table")
                table = scheme.readers()
                assert sorted(h.via for h in table.hosts) == ["node 1", "node 2"], table
                assert sorted(r.worker for r in table) == [0, 0, 1, 1] and table.version >= 1
            assert batch.shape == (2, 64)
            # Two nodes, two environments: their halves of a batch differ (TorchRL's receive
            # buffer alone would hold one node's frames twice).
            assert not torch.equal(batch["observation"][0], batch["observation"][1])
            seen += assert_tagged_with_the_weights_that_acted(batch)
            fill(policy, i + 2)
            batches += 1
    finally:
        collector.shutdown()
    assert batches == 768 // 128
    assert max(seen) >= batches - 2, f"the nodes fell behind the trainer's versions: {sorted(set(seen))}"


@needs_0_14
def test_distributed_collector_carries_the_trainers_version_to_each_node_it_updates():
    policy = make_probe_policy()
    fill(policy, 0)
    collector = two_nodes_with_shmsync("DistributedCollector", policy, frames_per_batch=64, total_frames=512)
    version, batches = 0, []
    try:
        for batch in collector:
            batches.append((node_of(batch), assert_tagged_with_the_weights_that_acted(batch), version))
            version += 1
            fill(policy, version)
            collector.update_policy_weights_()  # the trainer's version `version`, to every node
    finally:
        collector.shutdown()
    assert len(batches) == 512 // 64
    # A node collects one batch each time TorchRL releases it, which it does right after that
    # node delivered and the update above; an update to every node may land while a node
    # collects, and its workers then load it at their next step. So each batch runs the version
    # of its node's release (0 for its first) or newer, never newer than the trainer's at its
    # delivery, however unevenly the two nodes are scheduled.
    assert {node for node, _, _ in batches} == {1, 2}, "one node delivered every batch"
    released = {1: 0, 2: 0}
    for node, versions, trainer_version in batches:
        assert released[node] <= versions[0] and versions[-1] <= trainer_version, (
            f"node {node} ran {versions}, released at {released[node]}, delivered at {trainer_version}"
        )
        released[node] = trainer_version + 1


@needs_0_14
def test_each_push_sends_each_node_the_leaves_changed_since_its_version_and_every_frame_runs_the_trainers_bytes():
    """A frozen part (1 MiB) and a trained head (4 KB): each push sends a node the leaves that
    changed since the version it holds (the head alone; the frozen part too at the push after it
    changed through ``.data``: every leaf, so the whole weights), a node that missed a push the
    leaves changed since the one it holds, and every frame runs exactly the weights of the version
    it is tagged with."""
    policy = make_frozen_probe_policy()
    probe = policy.module
    head_bytes, frozen_bytes = 1000 * 4, 512 * 512 * 4

    def frozen_sum():
        return float(probe.frozen.data.view(torch.int32).to(torch.int64).sum())

    sums = {0: frozen_sum()}  # version -> the frozen part's sum it holds
    collector = two_nodes_with_shmsync("DistributedCollector", policy, frames_per_batch=64, total_frames=512)
    version, sent = 0, {}
    try:
        (leaves,) = collector._shmsync.leaves.values()
        for batch in collector:
            tags = assert_tagged_with_the_weights_that_acted(batch)
            for tag in tags:  # the frozen part of every frame is its version's, byte for byte
                frames = batch["frozen_sum"][batch["policy_version"] == tag]
                assert set(frames.flatten().tolist()) == {sums[tag]}, f"version {tag}'s frames ran another frozen part"
            version += 1
            with torch.no_grad():
                probe.head.fill_(version)
                if version == 4:
                    probe.frozen.data[0, 0] += 1.0  # the frozen part changes once, unseen by torch's counter
            sums[version] = frozen_sum()
            worker_ids = [0] if version == 2 else None  # push 2 reaches node 1 alone: node 2 misses it
            collector.update_policy_weights_(worker_ids=worker_ids)
            sent[version] = {rank: (t.version, t.last_bytes, t.last_delta) for rank, t in leaves.sent.items()}
    finally:
        collector.shutdown()
    assert version >= 6, f"only {version} pushes"
    assert sent[1] == {1: (1, head_bytes, True), 2: (1, head_bytes, True)}
    assert sent[2][1] == (2, head_bytes, True) and sent[2][2][0] == 1, "push 2 reached node 2"
    assert sent[3][2] == (3, head_bytes, True), "node 2, holding version 1, was not sent the head alone"
    whole = (4, head_bytes + frozen_bytes, False)  # both leaves changed: the whole weights
    assert sent[4] == {1: whole, 2: whole}
    assert all(t == (v, head_bytes, True) for v in range(5, version + 1) for t in sent[v].values()), sent


@pytest.mark.skipif(TORCHRL_VERSION >= (0, 14), reason="torchrl >= 0.14 takes shmsync as the local scheme")
@pytest.mark.parametrize("name", ["DistributedSyncCollector", "DistributedCollector"])
def test_older_torchrl_refuses_shmsync_as_the_local_leg_before_any_node_starts(name):
    import shmsync.torchrl.distributed as distributed

    with pytest.raises(NotImplementedError, match="needs torchrl >= 0.14"):
        getattr(distributed, name)(
            [make_pendulum],
            make_probe_policy(),
            frames_per_batch=64,
            total_frames=128,
            collector_kwargs={"weight_sync_schemes": {"policy": ShmWeightSyncScheme()}},
            launcher="mp",
            tcp_port=str(free_ports()),
        )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["DistributedSyncCollector", "DistributedCollector"])
def test_torchrls_own_collector_with_a_shmsync_local_leg_is_refused_before_any_node_starts(name):
    """TorchRL's class would carry no trainer version to its nodes (and its trainer would abort on
    the nodes' first batch, which has keys its receive buffers lack): refused as it starts its
    first node, naming the class to use instead."""
    import torchrl.collectors.distributed as distributed

    with pytest.raises(Exception, match=rf"shmsync\.torchrl\.distributed\.{name}"):
        getattr(distributed, name)(
            [make_pendulum],
            make_probe_policy(),
            frames_per_batch=64,
            total_frames=128,
            collector_kwargs={"weight_sync_schemes": {"policy": ShmWeightSyncScheme()}},
            launcher="mp",
            tcp_port=str(free_ports()),
        )
    # (the suite's leak check fails a test that leaves a node running)
