"""What counts as a change: a leaf is unchanged only when every byte is proved equal to the
newest version's, by the pages written or by comparison, whatever wrote it; a publish copies what
changed, and a copy checked after it was made holds one moment of a source another thread writes."""

import sys
import textwrap
import threading

import pytest
import torch

from shmsync import WeightReader
from shmsync.core import header
from shmsync.errors import WrittenWhileCopiedError
from shmsync.store.changes import TRACK_MIN_BYTES, same_bytes
from shmsync.writer.changes import SourceChanges
from tests.commands import python, run_command
from tests.routes import ROUTES, Policy, write
from tests.weights import ParamBlob, fill, mixed_values

PROOFS = ["written pages", "comparison"]


@pytest.fixture(params=PROOFS)
def proof(request, monkeypatch):
    """Each test under each proof: the pages written (the default here), and comparison (where
    write tracking is unavailable: another kernel, or SHMSYNC_WRITE_TRACKING=0)."""
    if request.param == "comparison":
        monkeypatch.setenv("SHMSYNC_WRITE_TRACKING", "0")
    return request.param


@pytest.mark.parametrize(
    "a, b",
    [
        (torch.tensor([0.0]), torch.tensor([-0.0])),  # equal values, other bytes
        (torch.tensor([float("nan")]), torch.tensor([0.0]).view(torch.int32).fill_(0x7FC00001).view(torch.float32)),
        (torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64)),  # another dtype
        (torch.tensor([1.0, 2.0]), torch.tensor([1.0])),  # another shape
        (torch.tensor([True]), torch.tensor([False])),
        (torch.tensor([1 + 2j]), torch.tensor([1 - 2j])),
        (torch.arange(12.0).reshape(3, 4).t(), torch.arange(12.0).reshape(4, 3)),  # strided
    ],
)
def test_leaves_that_differ_in_any_byte_are_changed(a, b):
    assert not same_bytes(a, b)


def test_leaves_with_the_same_bytes_are_unchanged_whatever_their_strides():
    held = torch.arange(12.0).reshape(3, 4)
    assert same_bytes(held.t().contiguous().t(), held)  # the same values, column-major
    nan = torch.tensor([float("nan"), 1.0])
    assert same_bytes(nan, nan.clone())  # the same NaN bytes: unchanged, though nan != nan
    assert same_bytes(torch.tensor([1 + 2j]), torch.tensor([1 + 2j]))


@pytest.mark.parametrize("how", ROUTES)
def test_every_way_of_writing_reaches_every_reader_byte_for_byte(store_factory, proof, how):
    """The head changes at every publish, the backbone only through ``how``: after each publish a
    private reader holds the trainer's bytes exactly, and once both slots hold the backbone as it
    is, a publish proves it unchanged and copies only the rest."""
    torch.manual_seed(0)
    policy = Policy()
    store = store_factory(policy, num_slots=2)  # each publish writes the slot of the version before last
    reader = WeightReader(store, Policy(), zero_copy=False)
    backbone = sum(t.numel() * t.element_size() for t in policy.backbone.parameters())
    for k in range(1, 4):
        write(policy, how, float(k))
        for n in range(3):
            with torch.no_grad():
                policy.head.weight.add_(1.0)  # the trained part
            store.publish(policy)
            reader.poll()
            trainer = {name: t.detach() for name, t in policy.state_dict().items()}
            for name, t in reader.module.state_dict().items():
                assert same_bytes(t, trainer[name].contiguous()), f"{how}, round {k}: {name} differs"
            copied = store.info()["copied_bytes"]
            if n == 2:  # both slots hold the backbone as it is: proved unchanged, not copied
                assert copied < store.nbytes - backbone, f"{how}, round {k}: {copied} bytes copied"
            elif how != "buffer in forward":  # the slot written held the backbone from before the write
                assert copied > backbone, f"{how}, round {k}: {copied} bytes copied"
    assert header.Proof.of_word(store.info()["unchanged_proof"]) == proof


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
        for _ in range(2000):  # until 10 of one kind: a busy host refuses more copies
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


@pytest.mark.skipif(
    __import__("shmsync.core.written_pages", fromlist=["x"]).unavailable_reason() is not None,
    reason="needs write tracking (Linux 6.7+)",
)
@pytest.mark.parametrize("order", ["train, then update", "update, then train"])
def test_a_leaf_an_optimizer_steps_is_tracked_only_over_the_stretch_it_stays_quiet(order):
    """An optimizer writes the leaf at every batch, so it is tracked only over the stretch of the
    loop in which nothing writes it: training, then the update's publish, then the hand-out is
    quiet from the publish to the hand-out (which proves it unchanged for free), and the leaf is
    let go at the hand-out, before training writes it (a fault on every page). Updating first,
    then training: the quiet stretch is from the hand-out's publish to the update's."""
    changes, version = SourceChanges(1), 0
    source = [torch.zeros(1 << 18)]  # 1 MB
    held = [source[0].clone()]
    tracked_after = {"publish": [], "hand-out": []}

    def look(moment: str) -> list[bool]:
        nonlocal version
        found = changes.find(source, held, moment)
        tracked_after[moment].append(changes.watch.tracked[0] is not None)
        if moment == "publish" or any(found):
            held[0].copy_(source[0])
            version += 1
            changes.published(version, version - 1, found)
        return found

    for _ in range(4):
        if order == "train, then update":
            source[0].add_(1.0)
            assert look("publish") == [True]
            assert look("hand-out") == [False]
        else:
            assert look("publish") == [False]
            source[0].add_(1.0)
            assert look("hand-out") == [True]
    if order == "train, then update":
        assert tracked_after["publish"][-2:] == [True, True] and not any(tracked_after["hand-out"])
    else:
        assert tracked_after["hand-out"][-2:] == [True, True] and not any(tracked_after["publish"][1:])
    changes.close()


def test_two_publishes_while_readers_hold_the_replaced_version_copy_only_what_changed(store_factory):
    """A loop that publishes at the update and again at the hand-out, its workers leasing the
    version before: the writer keeps a slot holding a version for its next write (none would be
    kept where every publish copies everything), so the second publish copies the head alone."""
    policy = ParamBlob({"backbone": 1 << 20, "head": 1024})  # 4 MB frozen, 4 KB trained
    store = store_factory(policy)
    reader = WeightReader(store, ParamBlob({"backbone": 1 << 20, "head": 1024}), zero_copy=True)
    for _ in range(6):
        reader.poll()  # the worker's next rollout: it leases the newest version
        for _ in range(2):  # the update's publish, then the hand-out's
            with torch.no_grad():
                policy.head.add_(1.0)
            store.publish(policy)
            store.flush()  # the give-backs of idle slots, landed
    info = store.info()
    assert info["copied_bytes"] < 1 << 16 and info["skipped_bytes"] >= 4 << 20, info


def test_a_copy_retried_after_a_write_copies_what_that_write_changed(store_factory, proof):
    """A leaf found unchanged, not copied (the slot held it already) and then written before the
    copy was checked (here from this thread, through a profile hook: the same moment every time)
    is copied by the next attempt, whatever slot it writes: the version holds the source as it
    stands, never that leaf's bytes from before the write beside another leaf's from after it."""
    sizes = {"a": 1 << 17, "b": 1 << 17, "c": 1 << 17}  # 512 KB each: tracked where the kernel can
    module = ParamBlob(sizes)
    store = store_factory(module)
    fill(module, 1.0)
    assert store.publish_if_changed(module) is not None
    reader = WeightReader(store, ParamBlob(sizes), zero_copy=True)
    for k in range(2, 6):  # only a changes: the slots come to hold b and c as they are
        with torch.no_grad():
            module.a.fill_(float(k))
        assert store.publish_if_changed(module) is not None
        if k in (3, 5):  # its lease keeps version 3's slot from being given back, then lets it go
            assert reader.poll()
    with torch.no_grad():
        module.a.fill_(6.0)
    written = []

    def write_b_before_the_first_check(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "written_since" and not written:
            written.append(True)
            with torch.no_grad():
                module.b.fill_(7.0)
                module.a.fill_(8.0)  # {a: 8, b: 1} never was: b was 7 by then

    # Another thread of the process, as the writer of such a race would be: the copy is checked.
    done = threading.Event()
    other = threading.Thread(target=done.wait, name="another writer")
    other.start()
    sys.setprofile(write_b_before_the_first_check)
    try:
        version = store.publish_if_changed(module)
    finally:
        sys.setprofile(None)
        done.set()
        other.join()
    assert written and version == store.version
    reader.close()
    weights = store.snapshot().weights
    assert {k: weights[k].unique().tolist() for k in sizes} == {"a": [8.0], "b": [7.0], "c": [1.0]}


def test_a_rewrite_of_the_same_bytes_copies_nothing(store_factory, proof):
    """``load_state_dict`` of an unchanged checkpoint writes every byte again, the same bytes: a
    publish finds every leaf as it was (the pages written compared, or every leaf compared), so it
    copies nothing, and a copying reader copies nothing either."""
    policy = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    store = store_factory(policy, num_slots=2)
    reader = WeightReader(
        store, torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512)), zero_copy=False
    )
    reader.poll()
    checkpoint = {k: v.clone() for k, v in policy.state_dict().items()}
    for _ in range(3):  # every slot holds these bytes, and the leaves are watched
        store.publish(policy)
        reader.poll()
    policy.load_state_dict(checkpoint)
    store.publish(policy)
    assert store.info()["copied_bytes"] == 0
    reader.poll()
    small = sum(t.numel() * 4 for t in policy.state_dict().values() if t.numel() * 4 < TRACK_MIN_BYTES)
    assert reader.copied_bytes == small  # the biases, copied at every reload: no proof of them is cheaper
    assert header.Proof.of_word(store.info()["unchanged_proof"]) == proof


def test_the_threads_multiprocessing_starts_are_not_writers():
    """A queue's feeder thread (TorchRL's collectors start them) writes no tensor: a copy made
    beside it needs no check; a thread of the user's does. In an interpreter of its own, whose
    only threads are the ones it starts (a test runner has threads of its own)."""
    script = textwrap.dedent(
        """
        import multiprocessing, threading
        from shmsync.writer.changes import others_may_write

        queue = multiprocessing.get_context("spawn").Queue()
        queue.put(1)  # starts its feeder thread
        assert any(t.name == "QueueFeederThread" for t in threading.enumerate())
        alone = others_may_write()
        done = threading.Event()
        user = threading.Thread(target=done.wait)
        user.start()
        beside_one = others_may_write()
        done.set(); user.join(); queue.get(timeout=10); queue.close(); queue.join_thread()
        print(alone, beside_one)
        """
    )
    out = run_command(python("-c", script), check=True, timeout=60).stdout.split()
    assert out == ["False", "True"]


def test_a_checked_copy_where_no_other_thread_runs_is_not_checked():
    """No other thread can write the source while this one copies it: the copy is the snapshot,
    and nothing is read a second time (in an interpreter of its own: no test runner's threads)."""
    script = textwrap.dedent(
        """
        import sys, torch
        from shmsync import WeightStore

        module = torch.nn.Linear(256, 256)
        checks = []
        with WeightStore.create(module) as store:
            torch.nn.init.ones_(module.weight)
            sys.setprofile(lambda frame, event, arg: checks.append(1) if (
                event == "call" and frame.f_code.co_name == "written_since") else None)
            version = store.publish(module, checked=True)
            sys.setprofile(None)
            ones = store.snapshot().weights["weight"].unique().tolist()
        print(version, len(checks), ones)
        """
    )
    assert run_command(python("-c", script), check=True, timeout=60).stdout.split() == ["1", "0", "[1.0]"]
