"""Copies split across threads give exactly what one copy_ gives."""

import pytest
import torch

from shmsync.writer.copies import PARALLEL_MIN_BYTES, copy_all, copy_threads


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
