"""Copying weights between tensors and a slot: batched, without autograd, and for large
payloads split across threads (``copy_`` releases the GIL, so each thread copies on a core of
its own while TorchRL keeps the trainer at one torch thread).

``SHMSYNC_COPY_THREADS`` fixes the thread count (1: never split); the default is the cores
this process may run on, at most 8. Payloads under ``PARALLEL_MIN_BYTES`` are copied by the
calling thread alone: below that, starting the other threads costs more than it saves.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import torch

PARALLEL_MIN_BYTES = 4 << 20
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0


def copy_threads() -> int:
    """How many threads a large copy is split across."""
    forced = os.environ.get("SHMSYNC_COPY_THREADS", "").strip()
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise ValueError(f"SHMSYNC_COPY_THREADS must be a positive integer, got {forced!r}")
        return int(forced)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


def copy_all(
    dst: list[torch.Tensor], src: list[torch.Tensor], on_cpu: bool | None = None, threads: int | None = None
) -> None:
    """``dst[i].copy_(src[i])`` for all i, batched, without autograd.

    Args:
        on_cpu: whether no tensor is on CUDA, when the caller already knows (hot paths).
        threads: split a large CPU copy across this many threads (default :func:`copy_threads`).
    """
    if on_cpu is None:
        on_cpu = not any(t.is_cuda for t in dst) and not any(t.is_cuda for t in src)
    grad = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)  # what no_grad() does, without its per-call overhead
    try:
        if on_cpu:
            if threads != 1 and _nbytes(dst) >= PARALLEL_MIN_BYTES:
                n = copy_threads() if threads is None else threads
                if n > 1:
                    _parallel_copy(dst, src, n)
                    return
            torch._foreach_copy_(dst, src)
        else:
            non_blocking = any(t.is_cuda for t in dst)
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=non_blocking)
            for dev in {t.device for t in (*dst, *src) if t.is_cuda}:
                torch.cuda.current_stream(dev).synchronize()
    finally:
        torch._C._set_grad_enabled(grad)


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _parallel_copy(dst: list[torch.Tensor], src: list[torch.Tensor], n: int) -> None:
    """Cut the pairs into ``n`` pieces of about equal bytes (splitting large contiguous
    tensors) and copy one piece per thread, this one included."""
    pieces = _Pieces(n, -(-_nbytes(dst) // n))
    for d, s in zip(dst, src):
        if d.is_contiguous() and s.is_contiguous() and d.dtype == s.dtype and d.shape == s.shape:
            pieces.add_split(d.view(-1), s.view(-1))
        else:  # broadcast or strided: copied whole, by whichever piece is being filled
            pieces.add(d, s)
    filled = [p for p in pieces.lists if p[0]]
    futures = [_executor().submit(_copy_piece, *p) for p in filled[1:]]
    _copy_piece(*filled[0])
    for f in futures:
        f.result()


class _Pieces:
    """``n`` lists of (destinations, sources), filled in turn up to ``share`` bytes each (the last
    takes the rest)."""

    def __init__(self, n: int, share: int) -> None:
        self.n, self.share = n, share
        self.lists: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [([], []) for _ in range(n)]
        self.piece, self.room = 0, share

    def add(self, d: torch.Tensor, s: torch.Tensor) -> None:
        self.lists[self.piece][0].append(d)
        self.lists[self.piece][1].append(s)
        self.room -= d.numel() * d.element_size()
        if self.room <= 0 and self.piece < self.n - 1:
            self.piece, self.room = self.piece + 1, self.share

    def add_split(self, d: torch.Tensor, s: torch.Tensor) -> None:
        """A flat pair, cut where a piece is full."""
        size, start = d.element_size(), 0
        while start < d.numel():
            rest = d.numel() - start
            take = rest if self.piece == self.n - 1 else min(rest, max(1, self.room // size))
            self.add(d[start : start + take], s[start : start + take])
            start += take


def _copy_piece(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    with torch.no_grad():  # grad mode is per thread
        torch._foreach_copy_(dst, src)


def _executor() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    if _pool is None or _pool_pid != os.getpid():  # a forked child gets a pool of its own
        _pool, _pool_pid = ThreadPoolExecutor(max_workers=7, thread_name_prefix="shmsync-copy"), os.getpid()
    return _pool
