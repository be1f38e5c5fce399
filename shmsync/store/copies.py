"""Copying weights between tensors and a slot: batched, without autograd, and for large
payloads split across threads (``copy_`` releases the GIL, so each thread copies on a core of
its own while TorchRL keeps the trainer at one torch thread). The writer copies into a slot, a
reader out of one, or compares its tensors with one (:func:`same_all`, split the same way). And
the store's background thread (:class:`Copier`), which runs what a publish hands over to land
after it returned: the give-backs of idle slots, a CUDA copy landing, the opt-in background copy.

``SHMSYNC_COPY_THREADS`` fixes the thread count (1: never split); the default is the cores
this process may run on, at most 8. Payloads under ``PARALLEL_MIN_BYTES`` are copied by the
calling thread alone: below that, starting the other threads costs more than it saves.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shmsync.core.pages import same_memories, same_memory
from shmsync.errors import InvalidArgumentError, ShmSyncError, WaitTimeoutError

PARALLEL_MIN_BYTES = 4 << 20
FIRST_BYTES = 4096  # what same_all compares on the calling thread first, range by range
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0


def copy_threads() -> int:
    """How many threads a large copy is split across."""
    forced = os.environ.get("SHMSYNC_COPY_THREADS", "").strip()
    if forced:
        if not forced.isdigit() or int(forced) < 1:
            raise InvalidArgumentError(f"SHMSYNC_COPY_THREADS must be a positive integer, got {forced!r}")
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
            if threads != 1 and sum(t.numel() * t.element_size() for t in dst) >= PARALLEL_MIN_BYTES:
                n = copy_threads() if threads is None else threads
                if n > 1:
                    _parallel_copy(dst, src, n)
                    return
            torch._foreach_copy_(dst, src)
        else:
            _copy_cuda(dst, src)
    finally:
        torch._C._set_grad_enabled(grad)


def same_all(ranges: list[tuple[int, int, int]], threads: int | None = None) -> list[bool]:
    """For each ``(a, b, length)`` of CPU memory: whether the ``length`` bytes at address ``a``
    equal those at ``b``. A large total is cut into pieces of about equal bytes, compared on as
    many threads (``memcmp`` releases the GIL; each stops at the first byte that differs).

    Examples:
        >>> import torch
        >>> x, y = torch.zeros(4), torch.tensor([0.0, 0.0, 0.0, 1.0])
        >>> same_all([(x.data_ptr(), y.data_ptr(), 12), (x.data_ptr(), y.data_ptr(), 16)])
        [True, False]
    """
    total = sum(n for _, _, n in ranges)
    n = copy_threads() if threads is None else threads
    if n <= 1 or total < PARALLEL_MIN_BYTES:
        return same_memories(ranges)
    # Most ranges that differ do so at once (a leaf an optimizer stepped): their first bytes tell,
    # on this thread, and only the ranges still equal there are split across the threads.
    head = same_memories([(a, b, min(length, FIRST_BYTES)) for a, b, length in ranges])
    if not any(head):
        return head
    rest = [(k, (a, b, n_)) for k, (same, (a, b, n_)) in enumerate(zip(head, ranges)) if same]
    if sum(r[2] for _, r in rest) < PARALLEL_MIN_BYTES:
        for k, (a, b, length) in rest:
            head[k] = same_memory(a, b, length)
        return head
    for (k, _), same in zip(rest, _same_split([r for _, r in rest], n)):
        head[k] = same
    return head


def _same_split(ranges: list[tuple[int, int, int]], n: int) -> list[bool]:
    """:func:`same_all` over ``n`` threads: the ranges cut into pieces of about equal bytes."""
    total = sum(length for _, _, length in ranges)
    share = -(-total // n)
    pieces: list[list[tuple[int, int, int, int]]] = [[]]  # (which range, a, b, length)
    room = share
    for k, (a, b, length) in enumerate(ranges):
        at = 0
        while at < length:
            take = min(length - at, room) if len(pieces) < n else length - at
            pieces[-1].append((k, a + at, b + at, take))
            at, room = at + take, room - take
            if room <= 0 and len(pieces) < n:
                pieces.append([])
                room = share
    same = [True] * len(ranges)

    def compare(piece: list[tuple[int, int, int, int]]) -> None:
        for k, a, b, length in piece:
            if same[k] and not same_memory(a, b, length):
                same[k] = False

    futures = [_executor().submit(compare, piece) for piece in pieces[1:] if piece]
    compare(pieces[0])
    for f in futures:
        f.result()
    return same


def _copy_cuda(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """Copies to or from a GPU, asynchronous where they can be, ended before returning (a reader
    validates what it copied right after)."""
    non_blocking = any(t.is_cuda for t in dst)
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=non_blocking)
    for dev in {t.device for t in (*dst, *src) if t.is_cuda}:
        torch.cuda.current_stream(dev).synchronize()


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


class Copier:
    """One background thread that runs one store's copies in the order they were handed over
    (started at the first, kept for the next ones): a publish that returns before its copy is done.

    The error of a task that raises is raised by the next :meth:`submit` or :meth:`wait` (the
    tasks behind it still run). While a task that
    reads the caller's weights runs (``guards_sources``), an optimizer step in this process waits
    for it (a step pre-hook, registered at the first such task), so a step does not write them
    meanwhile.

    Args:
        name: the thread's name (``shmsync-publish-STORE``).

    Examples:
        >>> copier = Copier("shmsync-publish-example")
        >>> done = []
        >>> copier.submit(lambda: done.append(1))
        >>> copier.wait(timeout=10.0)
        >>> done
        [1]
        >>> copier.close()
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self.pending = 0  # tasks handed over and not yet done
        self.guarding = 0  # of those, the ones that read the caller's weights
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closing = False

    def submit(self, task: Callable[[], object], *, guards_sources: bool = True) -> None:
        """Run ``task`` on the background thread, after the tasks handed over before it.

        Args:
            guards_sources: the task reads the caller's weights: optimizer steps wait for it.

        Raises:
            RuntimeError: an earlier task failed (its error is the cause); ``task`` is not run.
        """
        with self._cv:
            if self._error is not None:
                self._raise_pending()
            self._tasks.append((task, guards_sources))
            self.pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            if guards_sources:
                _watch_optimizers()
                self.guarding += 1
                _BUSY.add(self)
            self._cv.notify_all()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every task handed over is done.

        Raises:
            TimeoutError: tasks are still running after ``timeout`` seconds.
            RuntimeError: a task failed (its error is the cause).
        """
        with self._cv:
            if not self._cv.wait_for(lambda: self.pending == 0, timeout):
                raise WaitTimeoutError(f"{self.name}: a background copy did not end within {timeout} s")
            self._raise_pending()

    def close(self) -> None:
        """Wait for the tasks handed over, then end the thread."""
        with self._cv:
            self._cv.wait_for(lambda: self.pending == 0)
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def drain(self) -> None:
        """Wait until every task that reads the caller's weights is done, raising nothing (an
        error waits for the next :meth:`submit` or :meth:`wait`)."""
        with self._cv:
            self._cv.wait_for(lambda: self.guarding == 0)

    def _raise_pending(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise ShmSyncError(f"{self.name}: a background publish failed: {error}") from error

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._tasks or self._closing)
                if not self._tasks:
                    return
                task, guards = self._tasks.popleft()
            try:
                task()
            except BaseException as e:  # surfaced by the next submit() or wait()
                with self._cv:
                    self._error = self._error or e
            with self._cv:
                self.pending -= 1
                if guards:
                    self.guarding -= 1
                    if self.guarding == 0:
                        _BUSY.discard(self)
                self._cv.notify_all()


_BUSY: weakref.WeakSet = weakref.WeakSet()  # copiers with a task queued or running, in this process
_WATCHING = False


def _watch_optimizers() -> None:
    """Make every optimizer step of this process wait for the background copies running (once)."""
    global _WATCHING
    if not _WATCHING:
        _WATCHING = True
        register_optimizer_step_pre_hook(_wait_for_copies)


def _wait_for_copies(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for copier in list(_BUSY):
        copier.drain()  # a failed copy is raised by the store's next publish, not by this step
