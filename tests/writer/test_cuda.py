"""CUDA paths: versions in device slots on the trainer's GPU, readers in place on them in other
processes, host slots filled from them for the readers that need host memory, and publishing from
the GPU without stalling the trainer.

Skipped without a GPU; ``benchmarks/gpu_check.sh`` runs them on a GPU machine.
"""

import pytest
import torch

from shmsync import WeightReader
from shmsync.testing import page_locked
from tests.writer.cuda_readers import cuda_layers, cuda_reader

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _net(device="cpu"):
    torch.manual_seed(0)
    return cuda_layers().to(device)


def _fill(module, value):
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(float(value))


def test_a_store_published_from_cuda_keeps_its_versions_in_device_slots(store_factory):
    trainer = _net("cuda")
    store = store_factory(trainer)
    assert store.info()["device"] == 0 and store.memory.device_bytes > 0
    _fill(trainer, 3.0)
    v = store.publish(trainer)  # returns once promised: the copy lands on the store's thread
    assert store.info()["promised"] == v
    assert store.flush(timeout=30) == v == 1
    snap = store.snapshot()
    assert snap.version == 1 and all((t == 3.0).all() for t in snap.weights.values())


def test_the_next_optimizer_step_does_not_race_the_copy(store_factory):
    trainer = _net("cuda")
    store = store_factory(trainer)
    big = torch.randn(4096, 4096, device="cuda")
    for step in range(1, 20):
        _fill(trainer, step)
        store.publish(trainer)
        with torch.no_grad():  # the next "optimizer step", queued right behind the publish
            for p in trainer.parameters():
                p.add_(1000.0)
            big @ big  # keep the GPU busy so the copy is still in flight
    store.flush(timeout=30)
    snap = store.snapshot()
    assert snap.version == 19 and all((t == 19.0).all() for t in snap.weights.values())


@pytest.mark.parametrize(
    "device, options, viewing, mode",
    [
        ("cuda", {}, True, "device in place"),  # the default: runs on the leased device slot
        ("cuda", {"zero_copy": False}, False, "device"),  # a private device copy, for a policy that writes
        ("cuda", {"device_slots": False}, False, "device"),  # through the host slots
        ("cpu", {}, True, "in place"),  # a CPU reader of a CUDA store: host slots, filled once per version
    ],
)
def test_readers_in_other_processes_load_every_version_whole(store_factory, start, device, options, viewing, mode):
    trainer = _net("cuda")
    store = store_factory(trainer)
    child = start(cuda_reader, store.name, device, 5, options)
    (started_viewing,) = child.expect("ready", timeout=120)
    for version in range(1, 6):
        _fill(trainer, version)
        store.publish(trainer)  # no synchronize: the version lands when the device copy ended
        loaded, whole, now_viewing = child.expect("loaded", timeout=60)
        assert loaded == version and whole, f"version {version} loaded as {loaded}, whole: {whole}"
        assert now_viewing is viewing
    (row,) = store.readers()
    assert row.mode == mode and row.version == 5
    assert (row.device_bytes > 0) is (device == "cuda" and not viewing)
    child.conn.send("done")
    child.proc.join(30)


def test_a_reader_in_the_writers_process_runs_on_its_own_device_slots(store_factory):
    trainer = _net("cuda")
    store = store_factory(trainer)
    worker = _net("cuda")
    reader = WeightReader(store, worker)
    for version in range(1, 4):
        _fill(trainer, version)
        store.publish(trainer)
        reader.wait(version, timeout=30)
        assert reader.viewing and all((p == version).all() for p in worker.parameters())
    reader.close()
    assert all((p == 3).all() for p in worker.parameters()), "the module kept its weights, in memory of its own"


def test_a_meta_module_is_materialized_on_the_gpu(store_factory):
    store = store_factory(_net("cpu"))
    with torch.device("meta"):
        meta = cuda_layers()
    reader = WeightReader(store, meta, device="cuda")
    assert reader.poll() and next(meta.parameters()).is_cuda


def test_a_cpu_publish_follows_a_cuda_publish_in_flight(store_factory):
    """One write at a time: the CPU publish (copied to the device slots from now on) comes after
    the CUDA one, never in its slot."""
    gpu, cpu = _net("cuda"), _net("cpu")
    store = store_factory(cpu)
    big = torch.randn(4096, 4096, device="cuda")
    for round_ in range(1, 6):
        _fill(gpu, 2 * round_ - 1)
        _fill(cpu, 2 * round_)
        for _ in range(20):
            big = big @ big  # keep the device busy so the copy is still in flight
            big /= big.norm()
        v_gpu = store.publish(gpu)
        v_cpu = store.publish(cpu)  # while the CUDA copy may still be queued
        assert (v_gpu, v_cpu) == (2 * round_ - 1, 2 * round_)
        store.flush(timeout=30)
        snap = store.snapshot()
        assert snap.version == v_cpu and all((t == float(v_cpu)).all() for t in snap.weights.values())


def test_host_slots_filled_for_a_cpu_reader_are_page_locked_until_close(store_factory):
    from shmsync import WeightStore

    trainer = _net("cuda")
    store = WeightStore.create(trainer)
    reader = WeightReader(store, _net("cpu"))  # a reader of the host slots: they are filled from now on
    _fill(trainer, 2.0)
    store.publish(trainer)
    reader.wait(1, timeout=30)
    assert all((p == 2.0).all() for p in reader.module.parameters())
    assert page_locked(store), "the host slots were not page-locked for the device-to-host copies"
    reader.close()
    store.close()
    assert not page_locked(store)
