"""WeightStore and WeightReader across real spawned processes."""

import os
import pickle
import signal
import time

import pytest
import torch
from torch import nn

from shmsync import StoreNotFoundError, WeightReader, WeightStore, WriterBusyError

from procs import (
    STRESS_SIZES,
    Blob,
    attach_and_follow,
    blob_weights,
    lease_and_hang,
    set_all,
    slow_reader,
    stress_reader,
    stuck_reader,
    writer,
)

SMALL = {"a": 1000, "b": 300, "c": 7}


def test_create_publish_read_in_process(store_factory):
    policy = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    store = store_factory(policy)
    assert store.version == 0
    worker = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    reader = WeightReader(store, worker)
    assert reader.version == -1
    assert reader.poll() is True and reader.version == 0
    assert reader.poll() is False
    torch.testing.assert_close(worker[0].weight, policy[0].weight)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    assert store.publish(policy) == 1
    assert store.version == 1
    assert reader.poll() and reader.version == 1
    torch.testing.assert_close(worker[2].bias, policy[2].bias)


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


def test_a_snapshot_of_a_store_with_destinations_publishes_back(store_factory):
    store = store_factory({"policy": nn.Linear(3, 2), "value": nn.Linear(3, 1)})
    snap = store.snapshot()
    assert store.publish(snap.weights, version=7) == 7
    assert (store.snapshot().weights == snap.weights).all()


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


def test_snapshot_and_info(store_factory):
    store = store_factory(blob_weights(SMALL, 7.0), name=f"readable-{os.getpid()}")
    snap = store.snapshot()
    assert snap.version == 0 and float(snap.weights["a"][0]) == 7.0
    info = store.info()
    assert info["creator_pid"] == os.getpid() and info["num_slots"] == 3
    assert store.shm_bytes <= 3 * store.nbytes + (1 << 20)
    assert store.name == f"readable-{os.getpid()}"


def test_unique_default_names(store_factory):
    names = {store_factory(nn.Linear(1, 1)).name for _ in range(5)}
    assert len(names) == 5


def test_close_unlinks_and_attach_fails(store_factory):
    store = WeightStore.create(nn.Linear(2, 2))
    name = store.name
    assert os.path.exists(f"/dev/shm/shmsync-{name}")
    store.close()
    assert store.closed and not os.path.exists(f"/dev/shm/shmsync-{name}")
    with pytest.raises(StoreNotFoundError, match=name):
        WeightStore.attach(name)


def test_context_manager_unlinks():
    with WeightStore.create(nn.Linear(2, 2)) as store:
        name = store.name
        assert WeightStore.attach(name).version == 0
    with pytest.raises(StoreNotFoundError):
        WeightStore.attach(name)


def test_readers_survive_unlink(store_factory):
    store = store_factory(blob_weights(SMALL, 1.0))
    reader = WeightReader(store, Blob(SMALL))
    store.unlink()
    set_all(w := blob_weights(SMALL), 5.0)
    store.publish(w)
    assert reader.poll() and float(reader.module.a[0]) == 5.0


def test_the_creator_holds_the_writer_role_from_the_start(store_factory, start):
    store = store_factory(blob_weights(SMALL))  # created, never published
    child = start(writer, store.name, SMALL, 1)
    child.expect("ready")
    (msg,) = child.expect("busy")
    assert store.name in msg
    assert store.publish(blob_weights(SMALL, 1.0)) == 1  # the trainer is not locked out


def test_one_writer_at_a_time(store_factory, start):
    store = store_factory(blob_weights(SMALL))
    store.publish(blob_weights(SMALL, 1.0))  # this process now holds the writer role
    child = start(writer, store.name, SMALL, 1)
    child.expect("ready")
    (msg,) = child.expect("busy")
    assert store.name in msg
    other = WeightStore.attach(store.name)
    with pytest.raises(WriterBusyError):
        other.publish(blob_weights(SMALL, 9.0))
    other.close()
    assert store.version == 1
    store.release_writer()
    child = start(writer, store.name, SMALL, 3)
    child.expect("ready")
    assert child.expect("done")[0] == 4
    assert store.snapshot().weights["a"][0] == 4.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("by", ["name", "pickle"])
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


def test_store_pickles_to_same_memory(store_factory):
    store = store_factory(nn.Linear(2, 2))
    clone = pickle.loads(pickle.dumps(store))
    store.publish(nn.Linear(2, 2))
    assert clone.version == 1
    clone.close()


STRESS = STRESS_SIZES


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ordering", ["this-cpu", "weak"])
def test_torn_read_stress(store_factory, start, ordering, monkeypatch):
    """A writer publishes flat out; two readers check every reload holds exactly one version.

    ``weak``: every process orders memory as on aarch64 (real fences at every ordering point)."""
    if ordering == "weak":
        monkeypatch.setenv("SHMSYNC_ORDERING", "weak")  # inherited by the spawned processes
    store = store_factory(blob_weights(STRESS, 0.0))
    assert (store.memory.protocol.fence is store.memory.protocol.full_fence) == (ordering == "weak")
    store.release_writer()
    min_reloads = 2600
    readers = [start(stress_reader, store, STRESS, min_reloads) for _ in range(2)]
    for r in readers:
        r.expect("ready")
    w = start(writer, store.name, STRESS, 10**9)
    w.expect("ready")
    results = [r.expect("done", timeout=280) for r in readers]
    w.conn.send("stop")
    w.expect("done")
    total = sum(r[0] for r in results)
    assert total >= 5000, results
    assert sum(r[1] for r in results) == 0, f"mixed versions loaded: {results}"
    assert sum(r[2] for r in results) == 0, f"loaded values differ from the version tag: {results}"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["sigstop", "sigkill"])
def test_stuck_or_killed_reader_never_blocks_writer(store_factory, start, how):
    """A reader stopped or killed while it holds the token and a pin leaves the writer at full
    speed and the other readers correct."""
    store = store_factory(blob_weights(STRESS, 0.0))
    store.release_writer()
    stuck = start(stuck_reader, store, how)
    # Make the stuck reader's pin request get granted: publish once so the writer serves it.
    w = start(writer, store.name, STRESS, 5)
    w.expect("ready")
    stuck.expect("in-copy", timeout=60)
    w.expect("done")
    if how == "sigkill":
        os.kill(stuck.pid, signal.SIGKILL)
        stuck.proc.join(10)
    else:
        deadline = time.monotonic() + 10
        while _state_of(stuck.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
    healthy = [start(stress_reader, store, STRESS, 300) for _ in range(2)]
    for r in healthy:
        r.expect("ready")
    w = start(writer, store.name, STRESS, 10**9)
    w.expect("ready")
    results = [r.expect("done", timeout=100) for r in healthy]
    w.conn.send("stop")
    version, seconds, slowest = w.expect("done")
    # A 16 MB publish takes a few ms: one that waited on the stuck reader would take seconds.
    assert slowest < 0.5, f"a publish waited {slowest:.2f}s: the stuck reader held the writer up"
    assert sum(r[1] for r in results) == 0 and sum(r[2] for r in results) == 0, results


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("beside_a_lease", [False, True])
def test_no_starvation_under_back_to_back_publishing(store_factory, start, beside_a_lease):
    """A reader whose copy takes longer than several publishes still completes its loads, through
    the pinned fallback, while the writer republishes a large store back to back.

    Beside a lease: one of the 3 slots is leased by a zero-copy reader that never reloads; the
    slow reader's pin then goes to the leased slot, which costs the writer nothing."""
    big = {"a": 4_000_000, "b": 4_000_000}  # 32 MB
    store = store_factory(blob_weights(big, 0.0))
    store.release_writer()
    if beside_a_lease:
        holder = start(lease_and_hang, store, big)
        assert holder.expect("leased") == (True, 0)
    w = start(writer, store.name, big, 10**9)
    w.expect("ready")
    slow = start(slow_reader, store, big, 8, 0.05)
    slow.expect("ready")
    done, bad, retries, pinned, seconds = slow.expect("done", timeout=100)
    w.conn.send("stop")
    version, *_ = w.expect("done")
    assert done == 8 and bad == 0
    assert pinned >= 1, "the slow reader never needed the fallback: the test did not exercise it"
    # The first load fails its two optimistic copies (the reader does not know its copy time
    # yet); after that, knowing it is slower than the writer, each load is one pinned copy.
    assert retries <= 3, f"{retries} failed copies for {done} loads"
    assert version > 8


def _state_of(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_slow_readers_do_not_take_the_pin_off_each_other(store_factory, start):
    """Each reader's copy takes longer than the token wait before a takeover (0.25 s) and than
    many publishes: both still load, each through its own pin."""
    big = {"a": 4_000_000, "b": 4_000_000}  # 32 MB
    store = store_factory(blob_weights(big, 0.0))
    store.release_writer()
    w = start(writer, store.name, big, 10**9)
    w.expect("ready")
    slow = [start(slow_reader, store, big, 3, 0.2) for _ in range(2)]
    for r in slow:
        r.expect("ready")
    results = [r.expect("done", timeout=100) for r in slow]
    w.conn.send("stop")
    w.expect("done")
    for done, bad, _retries, pinned, seconds in results:
        assert done == 3 and bad == 0
        assert pinned >= 1, "no pinned load: the test did not exercise the fallback"
        assert seconds < 30, f"3 loads of 0.4 s copies took {seconds:.0f}s: readers fought over the pin"


def test_a_tensordict_changed_after_a_publish_is_checked_again(store_factory):
    from tensordict import TensorDict

    from shmsync import WeightMismatchError

    td = TensorDict({"a": torch.zeros(3), "b": {"c": torch.zeros(2, 2)}})
    store = store_factory({"policy": td.clone()})
    store.publish({"policy": td})
    td["b", "c"] = torch.ones(2, 2)  # a new tensor at a key: its values are published
    store.publish({"policy": td})
    assert store.snapshot().weights["policy", "b", "c"].sum() == 4
    td["a"] = torch.zeros(4)  # a new shape: refused, nothing written
    with pytest.raises(WeightMismatchError, match="'a' has shape \\(4,\\), the store holds \\(3,\\)"):
        store.publish({"policy": td})
    assert store.version == 2
