"""Write tracking (shmsync/core/written_pages.py), on this machine's kernel: exactly the pages written
are reported, whatever writes them (C, torch's in-place ops, ``.data``, NumPy, ``copy_``, optimizer
steps, another thread, the kernel's ``readinto``), none when nothing was; a page two ranges share
counts for both; memory unmapped or mapped anew comes back unknown, never unwritten; a forked child
neither uses nor disturbs its parent's tracker; and each way of being unavailable says why.

The memory is private anonymous mappings of the tests' own (torch tensors over them with
``torch.frombuffer``), so that no other allocation writes to their pages; one test tracks a tensor
on the heap as it comes.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import random
import select
import signal
import subprocess
import textwrap
import threading
import time

import pytest
import torch

from shmsync.core import written_pages
from shmsync.core.page_map import PAGEMAP_SCAN, UFFDIO_API, UFFDIO_REGISTER
from shmsync.core.written_pages import (
    ENV,
    TrackedRange,
    WrittenPages,
    for_this_process,
    unavailable_reason,
)
from shmsync.errors import ArgumentTypeError, InvalidArgumentError, ShmSyncError, WriteTrackingError
from tests.commands import python, run_command, start_command
from tests.core.descriptors import open_fds

P = mmap.PAGESIZE
REASON = unavailable_reason()
needs_tracking = pytest.mark.skipif(REASON is not None, reason=f"write tracking is unavailable here: {REASON}")

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MAP_FIXED = 0x10


@pytest.fixture
def pages():
    tracker = WrittenPages()
    yield tracker
    tracker.close()


class Memory:
    """A private anonymous mapping of ``n`` pages, written once so that its pages exist."""

    def __init__(self, n: int) -> None:
        self.size = n * P
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        address = libc.mmap(None, self.size, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        self.address = address
        ctypes.memset(address, 1, self.size)

    def write(self, offset: int, nbytes: int = 1) -> None:
        ctypes.memmove(self.address + offset, b"\7" * nbytes, nbytes)

    def tensor(self, offset: int = 0, nbytes: int | None = None) -> torch.Tensor:
        """A float32 tensor over ``[offset, offset + nbytes)`` of this memory."""
        nbytes = self.size - offset if nbytes is None else nbytes
        array = (ctypes.c_char * nbytes).from_address(self.address + offset)
        return torch.frombuffer(array, dtype=torch.float32)

    def replace(self, first_page: int, n: int) -> None:
        """Map fresh memory over pages ``[first_page, first_page + n)`` (as ``MAP_FIXED`` does)."""
        at = self.address + first_page * P
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED
        assert libc.mmap(at, n * P, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0) == at

    def unmap(self, first_page: int = 0, n: int | None = None) -> None:
        n = self.size // P - first_page if n is None else n
        assert libc.munmap(self.address + first_page * P, n * P) == 0


@pytest.fixture
def memory():
    made: list[Memory] = []

    def make(n: int) -> Memory:
        made.append(Memory(n))
        return made[-1]

    yield make
    for m in made:
        libc.munmap(m.address, m.size)  # pages unmapped already stay so


def pages_at(*page_runs: tuple[int, int]) -> list[tuple[int, int]]:
    """Spans of whole pages, ``(first page, count)`` each, as a range at a page's start sees them."""
    return [(first * P, n * P) for first, n in page_runs]


# -- the kernel's interface, as the upstream headers define it -------------------------------------------
# -- exactly what was written --------------------------------------------------------------------------------
@needs_tracking
def test_exactly_the_pages_written_are_reported_then_none(pages, memory):
    m = memory(16)
    (r,) = pages.track([(m.address, m.size)])
    assert pages.look([r]) == [[]]
    m.write(3 * P + 17)
    m.write(7 * P + P - 1, 2)  # the last byte of page 7 and the first of page 8
    assert pages.look([r]) == [pages_at((3, 1), (7, 2))]
    assert pages.look([r]) == [[]]
    assert r.unknown is None


@needs_tracking
def test_reads_are_not_writes(pages, memory):
    m = memory(8)
    t = m.tensor()
    (r,) = pages.track([(m.address, m.size)])
    assert float(t.sum()) != 0 and bytes(t.numpy()[:4].tobytes())
    assert ctypes.string_at(m.address, m.size)
    assert pages.look([r]) == [[]]


@needs_tracking
def test_a_range_off_page_boundaries_reports_its_own_bytes_on_each_written_page(pages, memory):
    """Rounded outward: a write beside the range on one of its edge pages is reported as the range's
    bytes on that page (the caller compares them); a page it does not touch never is."""
    m = memory(8)
    start, length = 100, 3 * P  # bytes [100, 3P + 100): pages 0 to 3
    (r,) = pages.track([(m.address + start, length)])
    m.write(10)  # page 0, before the range
    m.write(3 * P + 200)  # page 3, after it
    m.write(5 * P)  # page 5: not the range's
    assert pages.look([r]) == [[(0, P - start), (3 * P - start, start)]]
    m.write(P + 5)
    assert pages.look([r]) == [[(P - start, P)]]


@needs_tracking
def test_a_page_two_ranges_share_is_reported_to_each_whenever_each_looks(pages, memory):
    m = memory(8)
    first, second, same = pages.track([(m.address, P + 100), (m.address + P + 100, P), (m.address, P + 100)])
    m.write(P + 50)  # on page 1, in `first` (and `same`), beside `second`
    assert pages.look([first]) == [[(P, 100)]]  # the scan protects page 1 again ...
    assert pages.look([second, same]) == [[(0, P - 100)], [(P, 100)]]  # ... the others still get it
    assert pages.look([first, second, same]) == [[], [], []]


@needs_tracking
def test_tracking_a_range_keeps_the_writes_its_neighbour_made_on_their_shared_page(pages, memory):
    m = memory(8)
    (first,) = pages.track([(m.address, 2 * P + 8)])
    m.write(2 * P)  # first's last page
    (second,) = pages.track([(m.address + 2 * P + 8, P)])  # protects page 2 again
    assert pages.look([first, second]) == [[(2 * P, 8)], []]


@needs_tracking
def test_many_written_regions_refill_the_output_array():
    pages = WrittenPages(regions_per_scan=2)
    m = Memory(64)
    try:
        (r,) = pages.track([(m.address, m.size)])
        for i in range(0, 64, 2):
            m.write(i * P)
        assert pages.look([r]) == [pages_at(*[(i, 1) for i in range(0, 64, 2)])]
        assert pages.look([r]) == [[]]
        m.write(0, m.size)
        assert pages.look([r]) == [[(0, m.size)]]
    finally:
        pages.close()
        m.unmap()


@needs_tracking
def test_random_writes_and_looks_match_a_model(pages, memory):
    """Overlapping ranges, writes anywhere, looks at any subset: each look reports exactly the
    pages of the range written since that range's last look."""
    m = memory(32)
    spans = [(0, 5 * P + 7), (5 * P + 7, 9 * P), (3 * P, 20 * P + 3), (14 * P + 1, P), (25 * P, 6 * P)]
    ranges = pages.track([(m.address + a, n) for a, n in spans])
    unseen: dict[int, set[int]] = {i: set() for i in range(len(spans))}
    rng = random.Random(68)
    for _ in range(300):
        for page in rng.sample(range(32), rng.randint(0, 4)):
            m.write(page * P + rng.randrange(P))
            for i, (a, n) in enumerate(spans):
                if a // P <= page < -(-(a + n) // P):
                    unseen[i].add(page)
        asked = rng.sample(range(len(spans)), rng.randint(1, len(spans)))
        for i, got in zip(asked, pages.look([ranges[i] for i in asked])):
            a, n = spans[i]
            want = []
            for page in sorted(unseen[i]):
                low, high = max(page * P, a), min((page + 1) * P, a + n)
                if want and want[-1][0] + want[-1][1] == low - a:
                    want[-1] = (want[-1][0], want[-1][1] + high - low)
                else:
                    want.append((low - a, high - low))
            assert got == want
            unseen[i].clear()


# -- whatever writes them --------------------------------------------------------------------------------------
def _in_place(t, p, n):
    t[n // 2 : n // 2 + 10].add_(1)
    return [(n // 2 * 4, 40)]


def _through_data(t, p, n):
    p.data[3000] = 5  # torch's version counter does not see this one
    return [(3000 * 4, 4)]


def _through_numpy(t, p, n):
    t.numpy()[5 * P // 4 : 5 * P // 4 + 2000] = 9
    return [(5 * P, 8000)]


def _copy_into(t, p, n):
    t[100:200].copy_(torch.arange(100.0))
    return [(400, 400)]


def _adam_foreach(t, p, n):
    p.grad = torch.ones_like(p)
    torch.optim.Adam([p], lr=0.1, foreach=True).step()
    return [(0, n * 4)]


def _adam_fused(t, p, n):
    p.grad = torch.ones_like(p)
    torch.optim.Adam([p], lr=0.1, fused=True).step()
    return [(0, n * 4)]


def _sgd_on_a_slice(t, p, n):
    q = torch.nn.Parameter(t[2 * P // 4 : 3 * P // 4])  # one page of the range, as its own leaf
    q.grad = torch.ones_like(q)
    torch.optim.SGD([q], lr=0.5).step()
    return [(2 * P, P)]


def _another_thread(t, p, n):
    worker = threading.Thread(target=lambda: t[7 * P // 4].fill_(2))
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive()
    return [(7 * P, 4)]


def _readinto_from_a_file(t, p, n, tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 24)  # 6144 bytes: from the middle of page 1 into page 2
    with open(path, "rb", buffering=0) as f:
        assert f.readinto(memoryview(t.numpy()).cast("B")[P + P // 2 : P + P // 2 + 6144]) == 6144
    return [(P + P // 2, 6144)]


@needs_tracking
@pytest.mark.parametrize(
    "route",
    [
        _in_place,
        _through_data,
        _through_numpy,
        _copy_into,
        _adam_foreach,
        _adam_fused,
        _sgd_on_a_slice,
        _another_thread,
        _readinto_from_a_file,
    ],
)
def test_every_way_torch_and_the_kernel_write_a_tensor_is_seen(pages, memory, route, tmp_path):
    m = memory(16)
    t = m.tensor()
    p = torch.nn.Parameter(t)
    n = t.numel()
    (r,) = pages.track([(t.data_ptr(), t.nbytes)])
    with torch.no_grad():
        before = t.clone()
        wrote = route(t, p, n, tmp_path) if route is _readinto_from_a_file else route(t, p, n)
    changed = (t != before).nonzero().flatten()
    assert len(changed), "the route wrote nothing"
    first, last = wrote[0][0], wrote[-1][0] + wrote[-1][1]
    assert first <= int(changed[0]) * 4 and int(changed[-1]) * 4 < last
    expected = [(a - a % P, -(-(a + k) // P) * P - (a - a % P)) for a, k in wrote]
    assert pages.look([r]) == [expected]
    assert pages.look([r]) == [[]]


@needs_tracking
def test_a_tensor_on_the_heap_is_tracked_as_it_comes(pages):
    """A small tensor shares its edge pages with other objects: their writes may be reported too
    (as the tensor's bytes on those pages), its own always are."""
    t = torch.zeros(3000)  # 12000 bytes, on the heap
    (r,) = pages.track([(t.data_ptr(), t.nbytes)])
    t[2000] = 1
    (spans,) = pages.look([r])
    assert spans is not None and any(a <= 8000 < a + n for a, n in spans)
    assert all(a >= 0 and a + n <= t.nbytes for a, n in spans)


# -- unknown, never unwritten ---------------------------------------------------------------------------------
@needs_tracking
@pytest.mark.parametrize("mapped_anew", [True, False], ids=["unmapped-and-mapped-again", "unmapped"])
def test_memory_unmapped_is_unknown_and_its_run_neighbours_lose_nothing(pages, memory, mapped_anew):
    """Three adjacent ranges, one run: the middle one's memory goes (a scan with CHECK_WPASYNC fails
    on a mapping made anew; a hole, which scans skip, is caught by msync). The middle one comes back
    unknown; the pages written before and after it in the run are reported exactly."""
    m = memory(12)
    a, b, c = pages.track([(m.address, 4 * P), (m.address + 4 * P, 4 * P), (m.address + 8 * P, 4 * P)])
    m.write(1 * P)
    m.write(9 * P)
    if mapped_anew:
        m.replace(4, 4)
        m.write(5 * P)  # the new memory's writes are not the old range's: unknown all the same
    else:
        m.unmap(4, 4)
    assert pages.look([a, b, c]) == [pages_at((1, 1)), None, pages_at((1, 1))]
    assert "unmapped" in b.unknown
    assert pages.look([a, b, c]) == [[], None, []]
    m.write(2 * P)
    assert pages.look([a, c]) == [pages_at((2, 1)), []]
    if mapped_anew:  # tracked again, the new memory reports its own writes
        (b,) = pages.track([(m.address + 4 * P, 4 * P)])
        assert b.unknown is None and pages.look([b]) == [[]]
        m.write(6 * P)
        assert pages.look([a, b, c]) == [[], pages_at((2, 1)), []]


@needs_tracking
def test_memory_unmapped_before_tracking_is_refused(pages, memory):
    m = memory(4)
    m.unmap(2, 1)
    (r,) = pages.track([(m.address, m.size)])
    assert "is not mapped" in r.unknown and pages.look([r]) == [None]


@needs_tracking
def test_memory_others_can_write_is_refused(pages, memory, tmp_path):
    shared_tensor = torch.zeros(4096).share_memory_()
    shared = mmap.mmap(-1, 4 * P)  # MAP_SHARED
    path = tmp_path / "weights"
    path.write_bytes(b"\0" * 4 * P)
    with open(path, "r+b") as f:
        file_backed = mmap.mmap(f.fileno(), 4 * P, flags=mmap.MAP_PRIVATE)
    try:
        spans = [
            (shared_tensor.data_ptr(), shared_tensor.nbytes),
            (ctypes.addressof(ctypes.c_char.from_buffer(shared)), 4 * P),
            (ctypes.addressof(ctypes.c_char.from_buffer(file_backed)), 4 * P),
        ]
        ranges = pages.track(spans)
        assert all("not private anonymous memory" in r.unknown for r in ranges), ranges
        assert pages.look(ranges) == [None, None, None]
    finally:
        shared.close()
        file_backed.close()


@needs_tracking
def test_past_the_bound_of_runs_a_range_is_not_tracked_and_the_caller_copies(pages, memory):
    m = memory(16)
    pages.max_runs = 2
    first, second, third, beside = pages.track(
        [(m.address, P), (m.address + 4 * P, P), (m.address + 8 * P, P), (m.address + P, P)]
    )
    assert first.unknown is None and second.unknown is None
    assert "past this process's bound of 2" in third.unknown
    assert beside.unknown is None  # adjacent to a run: no run more
    m.write(8 * P)
    m.write(P)
    assert pages.look([first, second, third, beside]) == [[], [], None, [(0, P)]]


def _mappings_within(m: Memory) -> int:
    with open("/proc/self/maps") as f:
        rows = [line.split()[0].split("-") for line in f]
    return sum(1 for low, high in rows if int(low, 16) < m.address + m.size and int(high, 16) > m.address)


@needs_tracking
def test_tracking_splits_a_mapping_and_untracking_gives_it_back(pages, memory):
    m = memory(16)
    assert _mappings_within(m) == 1
    (r,) = pages.track([(m.address + 4 * P, 4 * P)])
    assert _mappings_within(m) == 3
    pages.untrack([r])
    assert _mappings_within(m) == 1
    assert pages.look([r]) == [None] and r.unknown == "untracked"
    pages.untrack([r])  # passed over


def _tracking_fds() -> set[int]:
    """This process's descriptors open on a userfaultfd or a pagemap file."""
    found = set()
    for fd in open_fds():
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # open_fds()'s own, closed since
            continue
        if target == "anon_inode:[userfaultfd]" or target.endswith("/pagemap"):
            found.add(fd)
    return found


@needs_tracking
def test_close_makes_every_range_unknown_and_closes_its_descriptors(memory):
    before = _tracking_fds()
    pages = WrittenPages()
    mine = _tracking_fds() - before
    assert sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in mine) == [
        "/proc/self/pagemap".replace("self", str(os.getpid())),
        "anon_inode:[userfaultfd]",
    ]
    assert not any(os.get_inheritable(fd) for fd in mine)  # O_CLOEXEC: an exec'd program gets neither
    m = memory(4)
    (r,) = pages.track([(m.address, m.size)])
    pages.close()
    pages.close()
    assert not (_tracking_fds() & mine)
    assert pages.look([r]) == [None] and "closed" in r.unknown and not pages.usable
    with pytest.raises(WriteTrackingError, match="closed"):
        pages.track([(m.address, m.size)])


@needs_tracking
def test_bad_arguments_are_refused_before_anything_is_tracked(pages, memory):
    m = memory(2)
    for spans, error in [
        ([(0, 10)], InvalidArgumentError),
        ([(m.address, 0)], InvalidArgumentError),
        ([(m.address, -5)], InvalidArgumentError),
        ([(1 << 63, P)], InvalidArgumentError),
        ([("1", 10)], ArgumentTypeError),
        ([(m.address, 1.5)], ArgumentTypeError),
        ([(m.address, True)], ArgumentTypeError),
        ([m.address], ArgumentTypeError),
        ([(m.address, P), (m.address, 0)], InvalidArgumentError),
    ]:
        with pytest.raises(error):
            pages.track(spans)
    assert _mappings_within(m) == 1  # nothing registered
    with pytest.raises(ArgumentTypeError, match="TrackedRange"):
        pages.look([(m.address, P)])
    with pytest.raises(InvalidArgumentError, match="regions_per_scan"):
        WrittenPages(regions_per_scan=0)
    with pytest.raises(ArgumentTypeError, match="regions_per_scan"):
        WrittenPages(regions_per_scan=2.0)
    assert pages.track([]) == [] and pages.look([]) == []


@needs_tracking
def test_a_range_of_another_tracker_is_unknown_here(pages, memory):
    other = WrittenPages()
    try:
        m = memory(2)
        (r,) = other.track([(m.address, m.size)])
        assert pages.look([r]) == [None]
        assert other.look([r]) == [[]]  # asking the wrong tracker cost it nothing
    finally:
        other.close()


@needs_tracking
def test_a_page_another_userfaultfd_holds_is_refused_by_the_kernel(pages, memory):
    other = WrittenPages()
    try:
        m = memory(4)
        (mine,) = pages.track([(m.address, 2 * P + 1)])
        (theirs,) = other.track([(m.address + 2 * P + 1, P)])  # shares page 2
        assert mine.unknown is None
        assert "refused to write-protect it (Device or resource busy)" in theirs.unknown
        m.write(2 * P + 5)
        assert pages.look([mine]) == [[(2 * P, 1)]] and other.look([theirs]) == [None]
    finally:
        other.close()


# A child interpreter that tracks memory of its own, says where, and looks once told to.
TRACKING_CHILD = textwrap.dedent(
    """
    import ctypes, mmap, os, sys
    from shmsync.core.written_pages import WrittenPages
    pages = WrittenPages()
    block = mmap.mmap(-1, 8 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    block.write(b"\\1" * len(block))
    address = ctypes.addressof(ctypes.c_char.from_buffer(block))
    (r,) = pages.track([(address, len(block))])
    print(address, flush=True)
    sys.stdin.readline()
    print(pages.look([r]), block[5 * mmap.PAGESIZE + 3], flush=True)
    """
)


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


@needs_tracking
@pytest.mark.timeout(60)
def test_another_process_writing_with_process_vm_writev_is_seen():
    child = start_command(python("-c", TRACKING_CHILD), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        address = int(child.stdout.readline())
        data = ctypes.create_string_buffer(b"\x2a", 1)
        local, remote = IoVec(ctypes.addressof(data), 1), IoVec(address + 5 * P + 3, 1)
        libc.process_vm_writev.restype = ctypes.c_ssize_t
        wrote = libc.process_vm_writev(child.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if wrote != 1:
            pytest.skip(f"process_vm_writev is not allowed here: {os.strerror(ctypes.get_errno())}")
        out, _ = child.communicate("look\n", timeout=30)
        assert out.split() == [f"[[({5 * P},", f"{P})]]", "42"]
    finally:
        child.kill()
        child.wait()


# -- forks -------------------------------------------------------------------------------------------------------
def _in_child(pages: WrittenPages, r: TrackedRange, m: Memory) -> int:
    """What a forked child checks; its exit status says which check failed (0: none)."""
    if pages.usable or pages.look([r]) != [None] or "forked" not in (r.unknown or ""):
        return 2
    try:
        pages.track([(m.address, P)])
        return 3
    except WriteTrackingError:
        pass
    m.write(5 * P)  # the child's copy of the page: never the parent's business
    own = for_this_process()
    if own is pages or not own.usable:
        return 4
    (mine,) = own.track([(m.address, m.size)])
    m.write(6 * P)
    return 0 if own.look([mine]) == [pages_at((6, 1))] else 5


@needs_tracking
@pytest.mark.timeout(60)
def test_a_forked_child_neither_uses_nor_disturbs_its_parents_tracker(pages, memory):
    m = memory(8)
    (r,) = pages.track([(m.address, m.size)])
    m.write(2 * P)  # before the fork: the child must not consume it
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status, never return into pytest
        status = 1
        try:
            status = _in_child(pages, r, m)
        finally:
            os._exit(status)
    deadline = time.monotonic() + 30
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child did not finish in 30 s")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert pages.usable and r.unknown is None
    assert pages.look([r]) == [pages_at((2, 1))]  # not the child's page 5 or 6
    m.write(7 * P)  # copy-on-write since the fork: a write like any other
    assert pages.look([r]) == [pages_at((7, 1))]


@needs_tracking
def test_one_tracker_per_process(memory):
    shared = for_this_process()
    assert for_this_process() is shared and shared.usable
    shared.close()
    again = for_this_process()
    assert again is not shared and again.usable


# -- unavailable, and why ----------------------------------------------------------------------------------------
def test_the_environment_variable_turns_it_off(monkeypatch):
    monkeypatch.setenv(ENV, "0")
    assert unavailable_reason() == f"turned off ({ENV}=0)"
    with pytest.raises(WriteTrackingError, match=f"{ENV}=0") as caught:
        WrittenPages()
    assert isinstance(caught.value, OSError) and isinstance(caught.value, ShmSyncError)
    with pytest.raises(WriteTrackingError, match=f"{ENV}=0"):
        for_this_process()
    monkeypatch.setenv(ENV, "yes")
    assert "neither 0 (off) nor 1 (on)" in unavailable_reason()
    monkeypatch.setenv(ENV, "1")
    assert unavailable_reason() == REASON


# A child interpreter that installs a seccomp filter making one system call (or one ioctl) fail
# with one errno, as a container's profile or an older kernel would, then asks (or, with "after",
# tracks a range first and looks at it under the filter).
SECCOMP_CHILD = textwrap.dedent(
    """
    import ctypes, mmap, sys
    nr, command, err = (int(a) for a in sys.argv[1:4])
    class Instruction(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]
    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Instruction))]
    def refuse():
        LOAD, JUMP_IF_EQUAL, JUMP, RETURN = 0x20, 0x15, 0x05, 0x06
        code = [(LOAD, 0, 0, 0), (JUMP_IF_EQUAL, 0, 3, nr)]  # the system call's number
        code += [(LOAD, 0, 0, 24), (JUMP_IF_EQUAL, 0, 1, command)] if command else [(JUMP, 0, 0, 1), (JUMP, 0, 0, 0)]
        code += [(RETURN, 0, 0, 0x00050000 | err), (RETURN, 0, 0, 0x7FFF0000)]  # fail with err, or allow
        program = (Instruction * len(code))(*[Instruction(*i) for i in code])
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
        if libc.prctl(22, 2, ctypes.byref(Program(len(code), program)), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER
            print("no seccomp"); sys.exit(0)
    from shmsync.core.written_pages import WrittenPages, unavailable_reason
    from shmsync.errors import WriteTrackingError
    if sys.argv[4:] == ["after"]:
        pages = WrittenPages()
        block = mmap.mmap(-1, 4 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        (r,) = pages.track([(ctypes.addressof(ctypes.c_char.from_buffer(block)), 4 * mmap.PAGESIZE)])
        refuse()
        block[0] = 1
        print(pages.look([r]), r.unknown)
        sys.exit(0)
    refuse()
    reason = unavailable_reason()
    try:
        WrittenPages()
        print("available")
    except WriteTrackingError as e:
        assert str(e) == reason, (str(e), reason)
        print(reason)
    """
)


def _under_seccomp(*args: object) -> str:
    child = run_command(python("-c", SECCOMP_CHILD, *map(str, args)), env={**os.environ, ENV: "1"}, check=True)
    if child.stdout.strip() == "no seccomp":
        pytest.skip("this process may not install a seccomp filter")
    return child.stdout


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the filter names x86-64's system call numbers")
@pytest.mark.parametrize(
    "nr, command, err, says",
    [
        (323, 0, errno.EPERM, "refused the userfaultfd system call"),
        (323, 0, errno.ENOSYS, "has no userfaultfd system call"),
        (16, UFFDIO_API, errno.EINVAL, "lacks asynchronous write-protection"),
        (16, PAGEMAP_SCAN, errno.ENOTTY, "lacks the PAGEMAP_SCAN ioctl"),
        (16, UFFDIO_REGISTER, errno.EINVAL, "refused to register anonymous memory"),
    ],
    ids=["seccomp-eperm", "no-syscall", "no-wp-async", "no-pagemap-scan", "register-refused"],
)
def test_each_way_the_kernel_says_no_is_named(nr, command, err, says):
    out = _under_seccomp(nr, command, err)
    if REASON is None or "userfaultfd" in says:
        assert says in out, out


@needs_tracking
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the filter names x86-64's system call numbers")
def test_a_scan_that_fails_leaves_its_ranges_unknown_never_unwritten():
    out = _under_seccomp(16, PAGEMAP_SCAN, errno.EIO, "after")
    assert out.startswith("[None] a scan of its pages failed: PAGEMAP_SCAN failed on "), out
    assert "Input/output error" in out


def test_importing_and_asking_never_raise_elsewhere():
    """The module imports, and answers, where nothing of this is: a machine the system call table
    does not name stands for any platform without it."""
    code = (
        "import platform; platform.machine = lambda: 'vax'; "
        "from shmsync.core.written_pages import unavailable_reason; print(unavailable_reason())"
    )
    child = run_command(python("-c", code), check=True)
    assert "not built for vax" in child.stdout


def test_the_probe_is_made_once_per_process(monkeypatch):
    calls = []
    monkeypatch.setattr(written_pages, "_probed", None)
    real = written_pages._probe
    monkeypatch.setattr(written_pages, "_probe", lambda: calls.append(1) or real())
    first = unavailable_reason()
    assert unavailable_reason() == first and calls == [1]


@needs_tracking
def test_no_fault_waits_on_the_userfaultfd(pages, memory):
    """Asynchronous mode: a write to a protected page never queues a fault message for a thread of
    ours to serve (there is none); the kernel resolves it, and the page counts as written."""
    m = memory(4)
    (r,) = pages.track([(m.address, m.size)])
    m.write(0, m.size)
    uffd = next(fd for fd in _tracking_fds() if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[userfaultfd]")
    readable, _, _ = select.select([uffd], [], [], 0)
    assert readable == [] and pages.look([r]) == [[(0, m.size)]]
