"""Copies split across threads give exactly what one copy_ gives."""

import pytest
import torch

from shmsync.store.copies import PARALLEL_MIN_BYTES, copy_all, copy_threads, same_all


@pytest.mark.parametrize("threads", [2, 3, 7])
def test_a_split_copy_equals_a_plain_one(threads):
    torch.manual_seed(0)
    n = PARALLEL_MIN_BYTES // 4
    src = [
        torch.randn(n),  # large enough to be cut
        torch.randn(3, 5).t(),  # strided: copied whole
        torch.randint(0, 100, (n // 3,), dtype=torch.int64),
        torch.randn(7, requires_grad=True),  # a parameter: no autograd record
        torch.randn(2, 1).expand(2, 9),  # broadcast
    ]
    dst = [torch.empty(t.shape, dtype=t.dtype) for t in src]
    copy_all(dst, src, on_cpu=True, threads=threads)
    for d, s in zip(dst, src):
        assert torch.equal(d, s.detach()) and not d.requires_grad


def test_the_thread_count_can_be_fixed(monkeypatch):
    monkeypatch.setenv("SHMSYNC_COPY_THREADS", "3")
    assert copy_threads() == 3
    monkeypatch.setenv("SHMSYNC_COPY_THREADS", "zero")
    with pytest.raises(ValueError, match="SHMSYNC_COPY_THREADS must be a positive integer, got 'zero'"):
        copy_threads()


# -- the background copier -------------------------------------------------------------------------
def test_a_copier_runs_tasks_in_order_and_a_failure_is_raised_once_by_the_next_call():
    from shmsync.store.copies import Copier

    copier = Copier("shmsync-publish-test")
    try:
        done = []
        for i in range(20):
            copier.submit(lambda i=i: done.append(i))
        copier.wait(timeout=10)
        assert done == list(range(20))

        def fail():
            raise OSError("no room")

        copier.submit(fail)
        copier.submit(lambda: done.append("after"))  # still queued behind the failure: it runs
        with pytest.raises(RuntimeError, match="a background publish failed: no room") as raised:
            copier.wait(timeout=10)
        assert isinstance(raised.value.__cause__, OSError) and done[-1] == "after"
        copier.wait(timeout=10)  # raised once
    finally:
        copier.close()


def test_an_optimizer_step_waits_for_the_copy_running():
    """A step would write the weights being copied: it waits for the copy to end."""
    import threading

    from shmsync.store.copies import Copier

    copier = Copier("shmsync-publish-test")
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([param], lr=1.0)
    param.grad = torch.ones(4)
    started, release, order = threading.Event(), threading.Event(), []

    def copy():
        started.set()
        release.wait(10)
        order.append("copy")

    try:
        copier.submit(copy)
        assert started.wait(10)
        stepper = threading.Thread(target=lambda: (optimizer.step(), order.append("step")))
        stepper.start()
        stepper.join(0.2)
        assert stepper.is_alive(), "the step did not wait for the copy"
        release.set()
        stepper.join(10)
        assert order == ["copy", "step"]
    finally:
        release.set()
        copier.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_memory_compared_in_pieces_tells_each_range_apart(threads):
    """Ranges compared across threads, cut where a piece is full: a byte that differs anywhere in a
    range, in any piece, makes that range differ and no other."""
    a = torch.zeros(3 << 20)  # 12 MiB: past PARALLEL_MIN_BYTES, split
    b = a.clone()
    b[(3 << 20) - 1] = 1.0  # the last element, in the last piece
    b[5] = -0.0  # equal values, another byte
    quarter = (3 << 20) // 4 * 4  # bytes in a quarter of the elements
    ranges = [(a.data_ptr() + k * quarter, b.data_ptr() + k * quarter, quarter) for k in range(4)]
    ranges.append((a.data_ptr(), b.data_ptr(), 0))
    assert same_all(ranges, threads=threads) == [False, True, True, False, True]
