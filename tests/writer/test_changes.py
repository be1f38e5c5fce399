"""What counts as a change: a leaf is unchanged only when every byte equals the slot's, and a copy
checked after it was made holds one state of a source that another thread writes."""

import threading

import pytest
import torch

from shmsync import WeightReader
from shmsync.errors import WrittenWhileCopiedError
from shmsync.writer.changes import changed_leaves, same_as, same_bytes
from tests.weights import ParamBlob, fill, mixed_values


@pytest.mark.parametrize(
    "a, b",
    [
        (torch.tensor([0.0]), torch.tensor([-0.0])),  # equal values, other bytes
        (torch.tensor([float("nan")]), torch.tensor([0.0]).view(torch.int32).fill_(0x7FC00001).view(torch.float32)),
        (torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64)),  # another dtype
        (torch.tensor([1.0, 2.0]), torch.tensor([1.0])),  # another shape
        (torch.tensor([True]), torch.tensor([False])),
        (torch.tensor([1 + 2j]), torch.tensor([1 - 2j])),
    ],
)
def test_leaves_that_differ_in_any_byte_are_changed(a, b):
    assert not same_bytes(a, b)
    assert changed_leaves([a], [b]) == [True]


def test_leaves_with_the_same_bytes_are_unchanged_whatever_their_strides():
    held = torch.arange(12.0).reshape(3, 4)
    source = held.t().contiguous().t()  # the same values, column-major
    assert same_bytes(source, held) and same_as([source], [held])
    nan = torch.tensor([float("nan"), 1.0])
    assert same_bytes(nan, nan.clone())  # the same NaN bytes: unchanged, though nan != nan
    assert same_bytes(torch.tensor([1 + 2j]), torch.tensor([1 + 2j]))


def test_publish_if_changed_publishes_only_what_differs_from_the_newest_version(store_factory):
    policy = torch.nn.Linear(4, 2)
    store = store_factory(policy)
    assert store.publish_if_changed(policy) is None and store.version == 0
    policy.bias.data[1] = -0.0 if float(policy.bias.data[1]) == 0.0 else 0.0  # .data: no version counter moves
    assert store.differs(policy)
    assert store.publish_if_changed(policy) == 1
    assert store.publish_if_changed(policy) is None and not store.differs(policy)
    reader = WeightReader(store, torch.nn.Linear(4, 2), zero_copy=False)
    reader.poll()
    assert torch.equal(reader.module.bias.view(torch.int32), policy.bias.detach().view(torch.int32))


def test_only_the_named_destinations_are_taken_from_the_source(store_factory):
    policy, value = torch.nn.Linear(3, 2), torch.nn.Linear(3, 1)
    store = store_factory({"policy": policy, "value": value})
    explicit = {k: v.clone() for k, v in value.state_dict().items()}
    explicit["bias"] += 5.0
    store.publish({"policy": policy, "value": explicit})  # the value head passed explicitly
    fill(policy, 2.0)
    fill(value, 9.0)  # never published: only the policy is taken from its module
    assert store.publish_if_changed({"policy": policy, "value": value}, only={"policy"}) == 2
    weights = store.snapshot().weights
    assert (weights["policy", "weight"] == 2.0).all()
    assert torch.equal(weights["value", "bias"], explicit["bias"])
    assert store.publish_if_changed({"policy": policy, "value": value}, only={"policy"}) is None


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pause_s", [0.005, 0.0], ids=["pausing writer", "writer flat out"])
def test_a_copy_made_while_another_thread_writes_is_one_state_or_nothing(store_factory, pause_s):
    """A thread fills every weight with 1, 2, 3, ... (pausing between fills, or not) while the
    main thread publishes whatever changed. Every version holds the weights as they were at one
    moment: the state k, or, where that moment fell inside the fill to k + 1, k + 1 up to where
    the fill stood and k after it; never a third value, which a copy spanning two fills would
    hold. Versions never go back, and a copy the writes kept reaching is refused by name."""
    sizes = {"a": 1 << 21, "b": 1 << 20, "c": 1000}  # 12 MB
    module = ParamBlob(sizes)
    store = store_factory(module)
    stop, filled = threading.Event(), [0]

    def write():
        k = 0
        while not stop.is_set():
            k += 1
            fill(module, float(k))
            filled[0] = k
            if pause_s:
                stop.wait(pause_s)

    writer = threading.Thread(target=write)
    writer.start()
    published, refused, values = 0, 0, []
    reader = WeightReader(store, ParamBlob(sizes), zero_copy=False)
    try:
        for _ in range(300):
            try:
                published += store.publish_if_changed(module) is not None
            except WrittenWhileCopiedError:
                refused += 1
            else:
                reader.poll()
                seen = sorted(mixed_values(reader.module))
                assert seen[-1] - seen[0] <= 1, f"version {reader.version} holds {seen}: more than one moment"
                values.append(seen[0])
            if (refused if not pause_s else published) >= 10:
                break
    finally:
        stop.set()
        writer.join(30)
    assert values == sorted(values), "a later version held an older state"
    if pause_s:
        assert published >= 10, (published, refused, filled[0])
    else:
        assert refused >= 10, (published, refused, filled[0])
