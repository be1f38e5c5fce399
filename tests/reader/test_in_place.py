"""Readers in place: parameters that point at leased, read-only slots of the store."""

import os
import signal
import time

import pytest
import torch
from torch import nn

from shmsync import SharedWeightsWrittenError, WeightReader, WeightStore
from shmsync.testing import hold_table_lock, slot_views
from tests.processes import in_place_reader, lease_and_hang, poll_in_place, write_through_view, writer
from tests.waiting import STUCK_S
from tests.weights import STRESS_SIZES, ParamBlob, blob_weights, mixed_values

SMALL = {"a": 1000, "b": 24}


def _publish(store, value, sizes=SMALL):
    return store.publish(blob_weights(sizes, value))


def _inside(tensor, store):
    """Whether ``tensor`` lies in the store's private mapping (a reader's)."""
    views = [v for slot in slot_views(store, private=True) for v in slot]
    lo = min(v.data_ptr() for v in views)
    hi = max(v.data_ptr() + v.nbytes for v in views)
    return lo <= tensor.data_ptr() < hi


def test_parameters_view_the_store_and_buffers_are_copied(store_factory):
    trainer = nn.Sequential(nn.Linear(4, 64), nn.BatchNorm1d(64))
    store = store_factory(trainer, num_slots=4)
    worker = nn.Sequential(nn.Linear(4, 64), nn.BatchNorm1d(64))
    reader = WeightReader(store, worker, zero_copy=True)
    assert reader.poll() and reader.viewing
    assert all(_inside(p, store) for p in worker.parameters())
    assert not any(_inside(b, store) for b in worker.buffers())
    with torch.no_grad():
        for p in trainer.parameters():
            p.fill_(2.0)
        trainer[1].running_mean.fill_(5.0)
    store.publish(trainer)
    assert reader.poll() and reader.version == 1
    assert float(worker[0].weight.detach().sum()) == 2.0 * 4 * 64
    assert float(worker[1].running_mean.mean()) == 5.0
    worker(torch.randn(8, 4))  # train mode: BatchNorm writes its (private) running stats
    assert [r.viewing for r in store.readers()] == [True]


def test_a_leased_slot_is_never_rewritten_and_the_rule_falls_back_to_copying(store_factory):
    store = store_factory(blob_weights(SMALL, 0.0), num_slots=3)  # at most one leased slot
    first, second = ParamBlob(SMALL), ParamBlob(SMALL)
    r1 = WeightReader(store, first, zero_copy=True)
    r2 = WeightReader(store, second, zero_copy=True)
    assert r1.poll() and r1.viewing
    _publish(store, 1.0)
    # A second distinct leased slot would leave the writer no free slot after its next publish.
    assert r2.poll() and not r2.viewing and mixed_values(second) == {1.0}
    for v in range(2, 40):
        _publish(store, float(v))  # never waits, never touches r1's slot
        assert mixed_values(first) == {0.0}
    assert r1.poll() and r1.viewing and mixed_values(first) == {39.0}
    assert r2.poll() and r2.viewing  # both on the latest slot now: one distinct leased slot
    assert mixed_values(second) == {39.0}


def test_a_viewing_reader_that_cannot_lease_copies_into_private_memory(store_factory):
    """A viewing reader is never refused by the rule (it gives its own slot back in the same
    step), but a busy table (a stopped reader holding it, say) makes it copy instead."""
    store = store_factory(blob_weights(SMALL, 0.0))
    module = ParamBlob(SMALL)
    reader = WeightReader(store, module, zero_copy=True)
    assert reader.poll() and reader.viewing
    _publish(store, 1.0)
    other = WeightStore.attach(store.name)  # another open file description: its lock conflicts
    try:
        with hold_table_lock(other):
            assert reader.poll() and not reader.viewing
    finally:
        other.close()
    assert not any(_inside(p, store) for p in module.parameters())
    assert mixed_values(module) == {1.0}
    with torch.no_grad():
        next(module.parameters()).add_(1.0)  # private again: writable
    _publish(store, 2.0)
    assert reader.poll() and reader.viewing and mixed_values(module) == {2.0}


def test_close_leaves_the_module_its_weights_in_private_memory(store_factory):
    store = store_factory(blob_weights(SMALL, 3.0))
    module = ParamBlob(SMALL)
    reader = WeightReader(store, module, zero_copy=True)
    reader.poll()
    reader.close()
    assert not any(_inside(p, store) for p in module.parameters())
    for v in range(4, 10):
        _publish(store, float(v))
    assert mixed_values(module) == {3.0}
    assert len(store.readers()) == 0
    assert reader.poll() and not reader.viewing and mixed_values(module) == {9.0}  # closed: copies

    survivor = ParamBlob(SMALL)
    WeightReader(store, survivor, zero_copy=True).poll()
    store.close()  # closes its readers in place first: the module keeps its weights
    assert mixed_values(survivor) == {9.0}


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_dead_readers_lease_is_cleared_by_a_recount(store_factory, start):
    store = store_factory(blob_weights(SMALL, 0.0), num_slots=3)  # one slot may be leased
    child = start(lease_and_hang, store, SMALL)
    assert child.expect("leased") == (True, 0)
    _publish(store, 1.0)
    module = ParamBlob(SMALL)
    reader = WeightReader(store, module, zero_copy=True)
    assert reader.poll() and not reader.viewing  # the live child holds another slot
    os.kill(child.pid, signal.SIGKILL)
    child.proc.join(10)
    _publish(store, 2.0)
    assert reader.poll() and reader.viewing and mixed_values(module) == {2.0}


def test_an_optimizer_step_on_viewing_parameters_raises_before_writing(store_factory):
    store = store_factory(blob_weights(SMALL, 7.0))
    module = ParamBlob(SMALL)
    assert all(p.requires_grad for p in module.parameters())
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    reader = WeightReader(store, module, zero_copy=True)
    assert reader.poll() and reader.viewing
    assert not any(p.requires_grad for p in module.parameters()), "viewing parameters must not want gradients"
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(RuntimeError, match=rf"parameter 'a' views the read-only shared memory of store '{store.name}'"):
        optimizer.step()
    version, weights = store.snapshot()
    assert version == 0 and all((t == 7.0).all() for t in weights.values())
    reader.close()  # private memory again: training it is fine
    assert not reader.viewing and all(p.requires_grad for p in module.parameters())
    optimizer.step()
    assert (module.a == 7.0 - 0.1).all()
    assert all((t == 7.0).all() for t in store.snapshot().weights.values())


@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_write_through_a_view_stays_in_its_process_and_the_next_reload_raises_and_undoes_it(store_factory, start):
    store = store_factory(blob_weights(SMALL, 7.0))
    child = start(write_through_view, store, SMALL)
    assert child.expect("wrote") == (True, 8.0, -1.0)  # no fault: its own module has the writes
    version, weights = store.snapshot()
    assert version == 0 and all((t == 7.0).all() for t in weights.values())  # the store's pages do not
    _publish(store, 9.0)
    child.conn.send(("published",))
    message, values = child.expect("refused")
    assert "wrote parameters ['a']" in message and "zero_copy=False" in message
    assert values == {7.0}  # undone: version 0, as published
    assert child.expect("then") == (1, True, {9.0})


def test_a_write_through_data_is_found_by_its_pages_and_undone(store_factory):
    store = store_factory(blob_weights(SMALL, 7.0))
    module = ParamBlob(SMALL)
    reader = WeightReader(store, module)
    assert reader.poll() and reader.viewing
    module.b.data.fill_(-1.0)  # .data: the parameter's version counter does not move
    assert mixed_values(module) == {7.0, -1.0}
    assert all((t == 7.0).all() for t in store.snapshot().weights.values())
    _publish(store, 9.0)
    with pytest.raises(SharedWeightsWrittenError, match=r"wrote [12] pages of its parameters"):
        reader.poll()
    assert mixed_values(module) == {7.0} and reader.version == 0
    assert reader.poll() and mixed_values(module) == {9.0}
    _publish(store, 10.0)
    assert reader.poll() and mixed_values(module) == {10.0}  # back on the slot it wrote: the store's pages


@pytest.mark.full  # a stress run: the lease tests above stay in `make test`
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("num_slots", [3, 4])
def test_in_place_stress(store_factory, start, num_slots):
    """A writer publishes 16 MB flat out; two readers in place check that every version they
    load is whole and stays unchanged while they hold it."""
    store = store_factory(blob_weights(STRESS_SIZES, 0.0), num_slots=num_slots)
    store.release_writer()
    readers = [start(in_place_reader, store, STRESS_SIZES, 150, 0.002) for _ in range(2)]
    for r in readers:
        r.expect("ready")
    w = start(writer, store.name, STRESS_SIZES, 10**9)
    w.expect("ready")
    results = [r.expect("done", timeout=220) for r in readers]
    w.conn.send("stop")
    w.expect("done")
    reloads, mixed, wrong_tag, changed, viewed = (sum(col) for col in zip(*results))
    assert reloads == 300
    assert mixed == 0 and wrong_tag == 0, results
    assert changed == 0, f"a leased slot was rewritten: {results}"
    assert viewed > 0, "no reload was in place: the test did not exercise leases"


@pytest.mark.slow  # every row of the table claimed first: seconds of CPU
def test_a_reader_without_a_row_in_a_full_table_copies_instead_of_leasing(store_factory):
    from shmsync.core.header import MAX_READERS

    store = store_factory(blob_weights(SMALL, 3.0), num_slots=4)
    taken = [store.rows.claim_row() for _ in range(MAX_READERS)]  # every row claimed, as each reader claims its own
    assert -1 not in taken and len(store.readers(processes=False)) == MAX_READERS
    module = ParamBlob(SMALL)
    reader = WeightReader(store, module, zero_copy=True)
    assert reader.poll() and not reader.viewing, "a reader with no row must not lease: its lease is invisible"
    assert mixed_values(module) == {3.0}
    _publish(store, 4.0)
    assert reader.poll() and not reader.viewing and mixed_values(module) == {4.0}
    reader.close()
    for row in taken:
        store.rows.release_row(row)


@pytest.mark.slow
def test_a_thread_stuck_in_one_stores_table_lock_stalls_no_other_store(store_factory):
    import threading
    import time

    a = store_factory(blob_weights(SMALL, 1.0), num_slots=4)
    b = store_factory(blob_weights(SMALL, 2.0), num_slots=4)
    holding, release = threading.Event(), threading.Event()

    def hold_a():
        with hold_table_lock(a):
            holding.set()
            release.wait()  # until the test ends: a reader that waited on the lock would hang

    holder = threading.Thread(target=hold_a)
    holder.start()
    try:
        assert holding.wait(10)
        reader = WeightReader(b, ParamBlob(SMALL), zero_copy=True)
        assert reader.poll() and reader.viewing, "a reload of another store waited on this store's lock"
        began = time.monotonic()
        # In the busy store itself, claiming a row gives up after a bound and the reader copies.
        stuck = WeightReader(a, module := ParamBlob(SMALL), zero_copy=True)
        assert stuck.poll() and not stuck.viewing and mixed_values(module) == {1.0}
        assert time.monotonic() - began < STUCK_S
    finally:
        release.set()
        holder.join(10)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("frozen_s", [pytest.param(5.0), pytest.param(30.0, marks=pytest.mark.full)])
def test_a_frozen_reader_costs_one_slot_while_frozen_and_nothing_once_it_moves_on(store_factory, start, frozen_s):
    sizes = {"a": 1 << 20}  # 4 MiB a copy
    store = store_factory(blob_weights(sizes, 0.0), num_slots=4)
    head, slot = store.memory.slot_range(0)
    child = start(poll_in_place, store, sizes)
    assert child.expect("loaded") == (True, 0)
    os.kill(child.pid, signal.SIGSTOP)
    try:
        version, end = 0, time.monotonic() + frozen_s
        while time.monotonic() < end:
            version += 1
            store.publish(blob_weights(sizes, float(version)))  # never waits for the frozen reader (or hangs)
            store.flush()  # the give-backs, on the store's thread
            # the latest, the next write's, and the version the frozen reader holds
            assert store.memory.resident_bytes() <= head + 3 * slot, f"after version {version}"
            time.sleep(0.005)
        assert store.readers()[0].version == 0
    finally:
        os.kill(child.pid, signal.SIGCONT)
    deadline = time.monotonic() + STUCK_S
    while store.readers()[0].version < version or store.memory.resident_bytes() > head + 2 * slot:
        assert time.monotonic() < deadline, (store.readers()[0].version, version, store.memory.resident_bytes())
        version += 1
        store.publish(blob_weights(sizes, float(version)))
        time.sleep(0.01)


def test_a_reader_maps_the_slots_once_privately_and_a_copying_reader_too(store_factory):
    store = store_factory(blob_weights(SMALL, 7.0))
    attached = WeightStore.attach(store.name)  # as a worker process would
    try:
        in_place = WeightReader(attached, ParamBlob(SMALL))
        copying = WeightReader(attached, ParamBlob(SMALL), zero_copy=False)
        assert in_place.poll() and copying.poll() and in_place.viewing and not copying.viewing
        segment = attached.memory.segment
        assert segment.mapped(shared=False) and not segment.mapped(shared=True)  # no writable view of the store
        in_place.close()
        copying.close()
    finally:
        attached.close()


def test_private_on_write_is_a_deprecated_name_of_keep_writes(store_factory):
    store = store_factory(blob_weights(SMALL, 7.0))
    reader = WeightReader(store, ParamBlob(SMALL))
    with pytest.warns(DeprecationWarning, match=r"keep_writes=True"):
        reader.private_on_write = True
    with pytest.warns(DeprecationWarning, match=r"removed in 0.4.0"):
        assert reader.private_on_write
    assert reader.keep_writes
    reader.close()


def test_a_reader_told_to_keep_writes_goes_on_with_a_private_copy(store_factory):
    """What TorchRL collectors ask for: loading a collector's state dict writes the policy's weights."""
    store = store_factory(blob_weights(SMALL, 7.0))
    module = ParamBlob(SMALL)
    reader = WeightReader(store, module, keep_writes=True)
    assert reader.poll() and reader.viewing
    with torch.no_grad():
        module.a.fill_(3.0)
    _publish(store, 9.0)
    assert reader.poll() and not reader.viewing and mixed_values(module) == {9.0}
    assert [r.mode for r in store.readers()] == ["copy"]
    assert all((t == 9.0).all() for t in store.snapshot().weights.values())  # nothing reached the store
