"""shmsync as each node's local leg under TorchRL's distributed collectors (torch.distributed,
gloo, ``launcher="mp"``: every node is a process of this machine, as hosts would be)."""

from __future__ import annotations

import socket

import pytest
import torch

from shmsync import ShmWeightSyncScheme
from shmsync._torchrl_compat import TORCHRL_VERSION

from helpers import make_pendulum, make_probe_policy

pytestmark = [pytest.mark.torchrl, pytest.mark.distributed, pytest.mark.timeout(240)]
needs_0_14 = pytest.mark.skipif(TORCHRL_VERSION < (0, 14), reason="shmsync's local leg needs torchrl >= 0.14")


def free_ports(n: int = 3) -> int:
    """A port p with p .. p+n-1 free (the collectors use tcp_port, +1 and +2)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as t:
                    t.bind(("", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free block of ports")


def fill(policy: torch.nn.Module, value: float) -> None:
    with torch.no_grad():
        for p in policy.parameters():
            p.fill_(value)


def two_nodes_with_shmsync(name: str, policy, **kwargs):
    """TorchRL's distributed collector ``name``: 2 nodes of 2 Pendulum workers each, shmsync as
    each node's local scheme."""
    import torchrl.collectors.distributed as distributed
    from torchrl.collectors import MultiSyncCollector

    return getattr(distributed, name)(
        [make_pendulum] * 2,
        policy,
        collector_class=MultiSyncCollector,
        num_workers_per_collector=2,
        collector_kwargs={"weight_sync_schemes": {"policy": ShmWeightSyncScheme()}},
        launcher="mp",
        tcp_port=str(free_ports()),
        **kwargs,
    )


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
    collector = two_nodes_with_shmsync("DistributedSyncCollector", policy, frames_per_batch=128, total_frames=1536)
    seen, batches = [], 0
    try:
        # Each batch starts with a push (update_interval=1): push n carries version n.
        fill(policy, 1)
        for i, batch in enumerate(collector):
            assert batch.shape == (2, 64)
            # Two nodes, two environments: their halves of a batch differ (TorchRL's receive
            # buffer alone would hold one node's frames twice).
            assert not torch.equal(batch["observation"][0], batch["observation"][1])
            seen += assert_tagged_with_the_weights_that_acted(batch)
            fill(policy, i + 2)
            batches += 1
    finally:
        collector.shutdown()
    assert batches == 1536 // 128
    assert max(seen) >= batches - 2, f"the nodes fell behind the trainer's versions: {sorted(set(seen))}"


@needs_0_14
def test_distributed_collector_carries_the_trainers_version_to_each_node_it_updates():
    policy = make_probe_policy()
    fill(policy, 0)
    collector = two_nodes_with_shmsync("DistributedCollector", policy, frames_per_batch=64, total_frames=768)
    version, per_batch = 0, []
    try:
        for batch in collector:
            per_batch.append(assert_tagged_with_the_weights_that_acted(batch))
            version += 1
            fill(policy, version)
            collector.update_policy_weights_()  # the trainer's version `version`
    finally:
        collector.shutdown()
    assert len(per_batch) == 768 // 64
    newest = [max(v) for v in per_batch]
    # Each batch comes from the node that delivered first, updated when TorchRL releases it
    # again (torchrl 0.14: before it collects; 0.11: the batch after), so a batch runs a
    # version or three behind the trainer, never further.
    assert newest[-1] >= len(per_batch) - 4, newest


@pytest.mark.skipif(TORCHRL_VERSION >= (0, 14), reason="torchrl >= 0.14 takes shmsync as the local leg")
@pytest.mark.parametrize("name", ["DistributedSyncCollector", "DistributedCollector"])
def test_older_torchrl_refuses_shmsync_as_the_local_leg_before_any_node_starts(name):
    import torchrl.collectors.distributed as distributed

    cls = getattr(distributed, name)
    with pytest.raises(NotImplementedError, match="needs torchrl >= 0.14"):
        cls(
            [make_pendulum],
            make_probe_policy(),
            frames_per_batch=64,
            total_frames=128,
            collector_kwargs={"weight_sync_schemes": {"policy": ShmWeightSyncScheme()}},
            launcher="mp",
            tcp_port=str(free_ports()),
        )
