"""Bad input: a clear error naming what is at fault, and nothing in shared memory changes."""

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from shmsync import StoreNotFoundError, WeightMismatchError, WeightReader, WeightStore


def _state(store):
    snap = store.snapshot()
    return store.version, snap.weights.clone()


def _assert_unchanged(store, before):
    version, weights = before
    assert store.version == version
    after = store.snapshot()
    assert after.version == version
    assert (after.weights == weights).all()


@pytest.fixture
def store(store_factory):
    return store_factory(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))


def test_publish_wrong_shape(store):
    before = _state(store)
    bad = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 5))
    with pytest.raises(WeightMismatchError, match=r"'1\.bias' has shape \(5,\), the store holds \(2,\)"):
        store.publish(bad)
    _assert_unchanged(store, before)


def test_publish_wrong_dtype(store):
    before = _state(store)
    bad = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).double()
    with pytest.raises(
        WeightMismatchError, match=r"'0\.bias' has dtype torch\.float64, the store holds torch\.float32"
    ):
        store.publish(bad)
    _assert_unchanged(store, before)


def test_publish_wrong_keys(store):
    before = _state(store)
    with pytest.raises(WeightMismatchError, match=r"missing \['1\.bias', '1\.weight'\]"):
        store.publish(nn.Sequential(nn.Linear(4, 3)))
    with pytest.raises(WeightMismatchError, match=r"unexpected \['2\.bias', '2\.weight'\]"):
        store.publish(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2), nn.Linear(2, 2)))
    _assert_unchanged(store, before)


def test_publish_wrong_type(store):
    before = _state(store)
    with pytest.raises(TypeError, match="nn.Module, a TensorDict, or a mapping"):
        store.publish([torch.zeros(3)])
    _assert_unchanged(store, before)


def test_publish_meta_tensors(store):
    before = _state(store)
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with pytest.raises(WeightMismatchError, match="meta device"):
        store.publish(meta)
    _assert_unchanged(store, before)


def test_publish_missing_destination(store_factory):
    store = store_factory({"policy": nn.Linear(2, 2), "value": nn.Linear(2, 1)})
    before = _state(store)
    with pytest.raises(WeightMismatchError, match=r"holds destinations \['policy', 'value'\], got \['policy'\]"):
        store.publish({"policy": nn.Linear(2, 2)})
    _assert_unchanged(store, before)


def test_attach_missing_name():
    with pytest.raises(StoreNotFoundError, match="no store named 'does-not-exist-42'"):
        WeightStore.attach("does-not-exist-42")


@pytest.mark.parametrize("name", ["", "a/b"])
def test_bad_names(name):
    with pytest.raises(ValueError, match="invalid store name"):
        WeightStore.create(nn.Linear(1, 1), name=name)


def test_name_taken(store_factory):
    store = store_factory(nn.Linear(1, 1))
    with pytest.raises(FileExistsError, match=store.name):
        WeightStore.create(nn.Linear(1, 1), name=store.name)


def test_empty_source():
    with pytest.raises(WeightMismatchError, match="nothing to store"):
        WeightStore.create(nn.ReLU())


def test_bad_num_slots():
    with pytest.raises(ValueError, match="num_slots"):
        WeightStore.create(nn.Linear(1, 1), num_slots=1)


def test_reader_module_mismatch(store):
    before = _state(store)
    with pytest.raises(WeightMismatchError, match=r"'0\.weight' has shape \(3, 5\), the store holds \(3, 4\)"):
        WeightReader(store, nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2)))
    with pytest.raises(WeightMismatchError, match="single module"):
        WeightReader(store, {"policy": nn.Linear(2, 2)})
    _assert_unchanged(store, before)


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


def test_tensordict_with_non_tensor(store_factory):
    td = TensorDict({"w": torch.zeros(2)})
    td.set_non_tensor("note", "hello")
    with pytest.raises(WeightMismatchError, match="'note'"):
        WeightStore.create(td)


def test_wait_timeout(store):
    reader = WeightReader(store, nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))
    with pytest.raises(TimeoutError, match="version 5 was not published within 0.05s"):
        reader.wait(5, timeout=0.05)
    assert reader.wait(0, timeout=1) == 0


def test_closed_store(store_factory):
    store = WeightStore.create(nn.Linear(1, 1))
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        store.publish(nn.Linear(1, 1))


def test_store_and_reader_import_without_torchrl():
    import subprocess
    import sys

    code = "import sys, shmsync; shmsync.WeightStore, shmsync.WeightReader; assert 'torchrl' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_attach_half_created_store():
    import os

    from shmsync import _segment

    name = f"half-created-{os.getpid()}"
    path = _segment.path_of(name)
    with open(path, "wb") as f:
        f.write(bytes(8192))  # a creator that died before writing the header
    try:
        with pytest.raises(StoreNotFoundError, match="still being created"):
            WeightStore.attach(name)
    finally:
        os.unlink(path)


def test_republishing_a_changed_module_is_still_checked(store):
    """The fast path for a module published before must notice every kind of change."""
    module = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    store.publish(module)
    store.publish(module)  # now on the fast path
    before = _state(store)
    module[0].weight.data = torch.zeros(3, 5)  # same Parameter object, new shape
    with pytest.raises(WeightMismatchError, match=r"'0\.weight' has shape \(3, 5\)"):
        store.publish(module)
    module[0].weight.data = torch.zeros(3, 4, dtype=torch.float64)
    with pytest.raises(WeightMismatchError, match=r"'0\.weight' has dtype torch\.float64"):
        store.publish(module)
    module[0].weight = nn.Parameter(torch.zeros(7))  # a new Parameter object
    with pytest.raises(WeightMismatchError, match=r"'0\.weight' has shape \(7,\)"):
        store.publish(module)
    module[0].weight = nn.Parameter(torch.zeros(3, 4))
    module.add_module("extra", nn.Linear(1, 1))  # a new submodule
    with pytest.raises(WeightMismatchError, match=r"unexpected \['extra\.bias', 'extra\.weight'\]"):
        store.publish(module)
    del module.extra
    module.to("meta")
    with pytest.raises(WeightMismatchError, match="meta device"):
        store.publish(module)
    _assert_unchanged(store, before)
    fresh = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with torch.no_grad():
        for p in fresh.parameters():
            p.fill_(2.0)
    v = store.publish(fresh)
    snap = store.snapshot()
    assert snap.version == v and all((t == 2.0).all() for t in snap.weights.values())


def test_publish_under_a_version_that_does_not_go_up(store):
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    assert store.publish(model, version=5) == 5
    before = _state(store)
    with pytest.raises(ValueError, match="version 5 is not higher than the last published version 5"):
        store.publish(model, version=5)
    with pytest.raises(ValueError, match="version 3 is not higher than the last published version 5"):
        store.publish(model, version=3)
    with pytest.raises(TypeError, match="version must be an int, got float"):
        store.publish(model, version=6.0)
    _assert_unchanged(store, before)
    assert store.publish(model) == 6  # without a version: the next one


def test_check_raises_what_publish_would_and_writes_nothing(store):
    before = _state(store)
    store.check(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))
    with pytest.raises(WeightMismatchError, match=r"'1\.bias' has shape \(5,\), the store holds \(2,\)"):
        store.check(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 5)))
    _assert_unchanged(store, before)


def test_out_of_shared_memory_says_what_is_needed_and_free():
    big = torch.zeros(1).expand(2**40 // 4)  # 1 TiB per slot, without the memory behind it
    with pytest.raises(
        OSError, match=r"cannot reserve 3072\.0 GiB in .* \(No space left on device; [\d.]+ [KMG]iB free"
    ):
        WeightStore.create(TensorDict({"a": big}))


def test_a_state_dict_with_a_stray_entry_names_that_entry(store):
    before = _state(store)
    state = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)).state_dict()
    state["1.bias"] = 0.5
    with pytest.raises(TypeError, match=r"state dict entry '1\.bias' is a float, not a tensor"):
        store.publish(state)
    _assert_unchanged(store, before)


def test_flat_tensordicts_with_dotted_keys_publish_and_name_real_differences(store):
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    assert store.publish(TensorDict(dict(model.state_dict()))) == 1
    before = _state(store)
    with pytest.raises(WeightMismatchError, match=r"missing \['0\.bias', '1\.bias', '1\.weight'\], unexpected \[\]"):
        store.publish(TensorDict({"0.weight": torch.zeros(3, 4)}))
    _assert_unchanged(store, before)


def test_the_constructor_points_to_create_and_attach():
    with pytest.raises(TypeError, match=r"WeightStore\.create\(source\).*WeightStore\.attach\(name\)"):
        WeightStore()
