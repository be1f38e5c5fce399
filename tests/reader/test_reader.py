"""WeightReader: loads the newest complete version into a module only when it changed, in place,
as a private copy; checks the module against the store; waits for versions; across real spawned
processes too."""

import time

import pytest
import torch
from torch import nn

from shmsync import NotLoadedError, WeightMismatchError, WeightReader
from tests.processes import attach_and_follow
from tests.weights import SMALL, Blob, assert_unchanged, blob_weights, set_all, store_state


@pytest.fixture
def store(store_factory):
    return store_factory(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))


def test_reader_module_mismatch(store):
    before = store_state(store)
    with pytest.raises(WeightMismatchError, match=r"'0\.weight' has shape \(3, 5\), the store holds \(3, 4\)"):
        WeightReader(store, nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2)))
    with pytest.raises(WeightMismatchError, match="single module"):
        WeightReader(store, {"policy": nn.Linear(2, 2)})
    assert_unchanged(store, before)


def test_reader_meta_module_mismatch_fails_on_first_load(store):
    with torch.device("meta"):
        wrong = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 7))
    reader = WeightReader(store, wrong)
    with pytest.raises(WeightMismatchError, match=r"'1\.bias' has shape \(7,\)"):
        reader.poll()
    assert reader.version == -1


def test_reader_destination_errors(store_factory):
    store = store_factory({"policy": nn.Linear(2, 2), "value": nn.Linear(2, 1)})
    with pytest.raises(WeightMismatchError, match="say which one"):
        WeightReader(store, nn.Linear(2, 2))
    with pytest.raises(WeightMismatchError, match="no destination 'critic'"):
        WeightReader(store, nn.Linear(2, 2), destination="critic")
    with pytest.raises(WeightMismatchError, match="no destination 'critic'"):
        WeightReader(store, {"critic": nn.Linear(2, 2)})


def test_wait_timeout(store):
    reader = WeightReader(store, nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))
    with pytest.raises(TimeoutError, match="version 5 was not published within 0.05s"):
        reader.wait(5, timeout=0.05)
    assert reader.wait(0, timeout=1) == 0


def test_worker_copy_is_private(store_factory):
    policy = nn.Linear(3, 3)
    store = store_factory(policy)
    worker = nn.Linear(3, 3)
    WeightReader(store, worker).poll()
    with torch.no_grad():
        policy.weight.zero_()
    assert worker.weight.abs().sum() > 0, "an unpublished in-place edit leaked into the worker"


def test_meta_module_first_load(store_factory):
    store = store_factory(nn.Linear(5, 3))
    with torch.device("meta"):
        worker = nn.Linear(5, 3)
    reader = WeightReader(store, worker)
    with pytest.raises(NotLoadedError, match=r"not loaded yet .*call reader.poll\(\) or reader.wait\(0\)"):
        worker(torch.zeros(5))  # used before its first load: named, not a torch device error
    assert reader.poll()
    assert worker.weight.device.type == "cpu"
    torch.testing.assert_close(worker.weight, store.snapshot().weights["weight"])


def test_several_destinations_share_one_version(store_factory):
    actor, critic = nn.Linear(2, 2), nn.Linear(2, 1)
    store = store_factory({"policy": actor, "value": critic})
    assert store.destinations == ("policy", "value")
    a2, c2 = nn.Linear(2, 2), nn.Linear(2, 1)
    both = WeightReader(store, {"policy": a2, "value": c2})
    only_policy = WeightReader(store, nn.Linear(2, 2), destination="policy")
    with torch.no_grad():
        actor.weight.fill_(3.0)
        critic.weight.fill_(4.0)
    v = store.publish({"policy": actor, "value": critic})
    assert both.poll() and only_policy.poll()
    assert both.version == only_policy.version == v == 1
    assert float(a2.weight.detach().mean()) == 3.0 and float(c2.weight.detach().mean()) == 4.0


def test_readers_survive_unlink(store_factory):
    store = store_factory(blob_weights(SMALL, 1.0))
    reader = WeightReader(store, Blob(SMALL))
    store.unlink()
    set_all(w := blob_weights(SMALL), 5.0)
    store.publish(w)
    assert reader.poll() and float(reader.module.a[0]) == 5.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("by", ["name", "pickle"])
@pytest.mark.slow
def test_children_attach_and_see_versions_in_order(store_factory, start, by):
    store = store_factory(blob_weights(SMALL, 0.0))
    arg = store.name if by == "name" else store
    children = [start(attach_and_follow, arg, SMALL, 20) for _ in range(2)]
    for c in children:
        c.expect("ready")
    w = blob_weights(SMALL)
    for v in range(1, 21):
        set_all(w, v)
        assert store.publish(w) == v
        time.sleep(0.002)
    for c in children:
        (seen,) = c.expect("seen")
        versions = [v for v, _ in seen]
        assert versions == sorted(versions) and versions[-1] == 20
        assert all(values == [float(v)] for v, values in seen)


def test_explicit_versions_reach_readers(store_factory):
    policy = nn.Linear(3, 2)
    store = store_factory(policy)
    reader = WeightReader(store, nn.Linear(3, 2))
    reader.poll()
    with torch.no_grad():
        policy.weight.fill_(7.0)
    assert store.publish(policy, version=1000) == 1000 == store.version
    assert reader.poll() and reader.version == 1000
    torch.testing.assert_close(reader.module.weight, policy.weight)
    assert not reader.poll()
    assert store.publish(policy) == 1001 and reader.poll() and reader.version == 1001
