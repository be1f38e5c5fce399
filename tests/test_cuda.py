"""CUDA paths: pinned slots, publishing from the GPU without stalling, reloading into GPU modules.

Skipped without a GPU; `benchmarks/gpu_check.sh` runs them on a GPU machine.
"""

import pytest
import torch
from torch import nn

from shmsync import WeightReader
from shmsync.testing import page_locked

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _layers():
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))


def _net(device="cpu"):
    torch.manual_seed(0)
    return _layers().to(device)


def test_publish_from_cuda_is_visible_after_flush(store_factory):
    trainer = _net("cuda")
    store = store_factory(trainer)
    with torch.no_grad():
        for p in trainer.parameters():
            p.fill_(3.0)
    v = store.publish(trainer)
    assert page_locked(store), "the slots were not page-locked"
    assert store.flush(timeout=30) == v == 1
    snap = store.snapshot()
    assert snap.version == 1 and all((t == 3.0).all() for t in snap.weights.values())


def test_next_optimizer_step_does_not_race_the_copy(store_factory):
    trainer = _net("cuda")
    store = store_factory(trainer)
    big = torch.randn(4096, 4096, device="cuda")
    for step in range(1, 20):
        with torch.no_grad():
            for p in trainer.parameters():
                p.fill_(float(step))
        store.publish(trainer)
        with torch.no_grad():  # the next "optimizer step", queued right behind the publish
            for p in trainer.parameters():
                p.add_(1000.0)
            big @ big  # keep the GPU busy so the copy is still in flight
    store.flush(timeout=30)
    snap = store.snapshot()
    assert snap.version == 19 and all((t == 19.0).all() for t in snap.weights.values())


def test_cuda_reader(store_factory):
    trainer = _net()
    store = store_factory(trainer)
    worker = _net().cuda()
    with torch.no_grad():
        for p in worker.parameters():
            p.zero_()
    reader = WeightReader(store, worker)
    assert reader.poll()
    for a, b in zip(worker.parameters(), trainer.parameters()):
        torch.testing.assert_close(a.cpu(), b)
    with torch.device("meta"):
        meta = _layers()  # no storage: the reader allocates it on the device
    reader = WeightReader(store, meta, device="cuda")
    assert reader.poll() and next(meta.parameters()).is_cuda


def test_close_unregisters(store_factory):
    from shmsync import WeightStore

    store = WeightStore.create(_net("cuda"))
    store.publish(_net("cuda"))
    store.close()
    assert not page_locked(store)


def test_a_cpu_publish_follows_a_cuda_publish_in_flight(store_factory):
    """One write at a time: the CPU publish waits for the CUDA one, never picks its slot."""
    gpu, cpu = _net("cuda"), _net("cpu")
    store = store_factory(cpu)
    big = torch.randn(4096, 4096, device="cuda")
    for round_ in range(1, 6):
        with torch.no_grad():
            for p in gpu.parameters():
                p.fill_(float(2 * round_ - 1))
            for p in cpu.parameters():
                p.fill_(float(2 * round_))
        for _ in range(20):
            big = big @ big  # keep the device busy so the copy is still in flight
            big /= big.norm()
        v_gpu = store.publish(gpu)
        v_cpu = store.publish(cpu)  # while the CUDA copy may still be queued
        assert (v_gpu, v_cpu) == (2 * round_ - 1, 2 * round_)
        snap = store.snapshot()
        assert snap.version == v_cpu and all((t == float(v_cpu)).all() for t in snap.weights.values())
    store.release_writer()  # waits for nothing in flight: the last publish was on the CPU
