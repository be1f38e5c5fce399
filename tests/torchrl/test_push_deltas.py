"""Which leaves a push of shmsync's distributed collectors sends each node
(shmsync/torchrl/push_deltas.py): those changed since the version the node holds, found as a store's
writer finds them; a node's checks of the list it is sent. The pushes themselves, over gloo between
processes, are in tests/torchrl/test_distributed.py."""

from __future__ import annotations

import json

import pytest
import torch
from tensordict import TensorDict

from shmsync.errors import ShmSyncError
from shmsync.torchrl.push_deltas import LEAVES_KEY, NodeLeaves, TrainerLeaves, _names_digest, leaf_keys, parse_list

pytestmark = [pytest.mark.slow, pytest.mark.torchrl]


def weights():
    return TensorDict(
        {"trunk": {"weight": torch.randn(256, 256)}, "head": {"weight": torch.zeros(8, 4), "bias": torch.zeros(8)}}
    )


@pytest.mark.parametrize("proof", ["written pages", "comparison"])
def test_each_node_is_sent_the_leaves_changed_since_the_version_it_holds(monkeypatch, proof):
    if proof == "comparison":
        monkeypatch.setenv("SHMSYNC_WRITE_TRACKING", "0")
    td, store = weights(), torch.distributed.HashStore()
    trainer = TrainerLeaves(store)
    keys = leaf_keys(td)
    assert keys == [("head", "bias"), ("head", "weight"), ("trunk", "weight")]
    trainer._find(td, 0)
    trainer.buffer_versions = {1: 0, 2: 0}  # both started from version 0
    for push in (1, 2, 3):
        td["head", "bias"].data += 1.0  # through .data: torch's version counter does not see it
        if push == 3:
            td["trunk", "weight"].numpy()[0, 0] = -5.0  # through NumPy
        trainer.begin(push)
        trainer._find(td, push)
        if push == 2:  # node 2 misses push 2
            assert trainer._leaves_for(1) == [0]
            trainer.confirmed(1, 2, True)
        else:
            want = [0] if push == 1 else [0, 2]
            assert trainer._leaves_for(1) == want and trainer._leaves_for(2) == want
            trainer.confirmed(1, push, True)
            trainer.confirmed(2, push, push != 3)  # node 2's answer to push 3 was not that version
    assert trainer._leaves_for(2) is None, "a node that holds nothing known is sent the whole weights"
    trainer.begin(4)
    trainer._find(td, 4)
    assert trainer._leaves_for(1) == [], "nothing changed since push 3"


@pytest.mark.parametrize(
    "doc, match",
    [
        (b"not json", r"not JSON"),
        (json.dumps([1, 2]).encode(), r"not \{push, base, leaves, names\}"),
        ({"push": 0, "base": -1, "leaves": None}, r"names push 0 from version -1"),
        ({"push": 3, "base": 3, "leaves": [0]}, r"names push 3 from version 3"),
        (
            {"push": 3, "base": 2, "leaves": [0, 3]},
            r"names leaf 3 after leaf 0: out of range \(this node's weights have 3",
        ),
        ({"push": 3, "base": 2, "leaves": [1, 0]}, r"names leaf 0 after leaf 1: not in increasing order"),
        ({"push": 3, "base": 2, "leaves": [True]}, r"names leaf True after leaf -1"),
        ({"push": 3, "base": 2, "leaves": [0], "names": "another model"}, r"of other leaves than this node's 3"),
        (b"[" * 5_000_000, r"not text of at most"),
    ],
)
def test_a_list_that_does_not_fit_the_nodes_weights_is_refused_by_name(doc, match):
    keys = leaf_keys(weights())
    if isinstance(doc, dict):
        doc = json.dumps({"names": _names_digest(keys), **doc}).encode()
    with pytest.raises(ShmSyncError, match=match):
        parse_list(doc, keys)


def test_a_node_refuses_a_push_of_the_leaves_changed_since_another_version_than_its_buffer_holds():
    td, store = weights(), torch.distributed.HashStore()
    node = NodeLeaves(store, 1, td)
    node.buffer_version = 4
    keys = leaf_keys(td)
    doc = {"push": 6, "base": 3, "leaves": [0], "names": _names_digest(keys)}
    store.set(LEAVES_KEY.format(rank=1), json.dumps(doc))
    assert node._take_list(keys) == (6, 3, [0])  # received all the same: the trainer sends those leaves
    assert node.refused[6] == "push 6 sent node 1 the leaves changed since version 3, but its buffer holds version 4"
    assert not store.check([LEAVES_KEY.format(rank=1)]), "a list is read once"


def test_a_node_that_refused_a_push_publishes_nothing_of_it_and_the_trainer_is_told(monkeypatch):
    """The node's collector asks for the push's number before it publishes: a refused push raises
    there, and the node writes the error back for the trainer's check of the push."""
    from types import SimpleNamespace

    from shmsync.torchrl import push_deltas, remote_nodes

    store = torch.distributed.HashStore()
    node = NodeLeaves(store, 1, weights())
    node.refused[6] = "push 6 sent node 1 the leaves changed since version 3, but its buffer holds version 4"
    monkeypatch.setattr(push_deltas, "_NODES", [node])
    pushes = remote_nodes.NodePushes(SimpleNamespace(worker_idx=1), "policy", None)
    pushes._client = store
    store.set(remote_nodes.PUSH_KEY, "6")
    with pytest.raises(ShmSyncError, match=r"node 1 refused the leaves it was sent: push 6 sent node 1 the leaves"):
        pushes.take()
    assert pushes.take() == 6, "a refusal is answered once, for its push"
