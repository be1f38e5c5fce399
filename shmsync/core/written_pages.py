"""Which pages of this process's own memory were written since it last looked (no torch here).

A caller registers byte ranges of its memory (a tensor's data: its address and length) with
:meth:`WrittenPages.track`, and asks :meth:`WrittenPages.look` which bytes of each range lie on
pages written since the range's last look: a list of ``(offset, length)`` spans, empty when no
page of the range was written, or ``None`` when that cannot be known (the caller copies the whole
range). The spans let a caller that compares content compare only the written pages, and only
the bytes of the range on them: a range shares its edge pages with whatever the allocator put
beside it, and a write there says nothing about the range's own bytes.

The kernel keeps the record: on Linux 6.7 and later a process can write-protect its own anonymous
memory asynchronously (userfaultfd in ``UFFD_FEATURE_WP_ASYNC`` mode, opened with
``UFFD_USER_MODE_ONLY``, which needs no privilege) and ask which pages were written since, and
protect them again, in one call (``PAGEMAP_SCAN`` on ``/proc/self/pagemap``).
:func:`unavailable_reason` says why that is not available here, or ``None``; the environment
variable ``SHMSYNC_WRITE_TRACKING=0`` turns it off.

One per process
---------------
Whether a page was written is one bit per page of the process, and a look clears it: two trackers
over one page would each clear the other's evidence. So a process has one tracker
(:func:`for_this_process`), which every store in it shares. It keeps the tracked ranges as *runs*:
the union of the ranges' pages, overlapping or adjacent ones merged, each run scanned whole. A
written page is credited to every tracked range that overlaps it (two tensors on one page, the
same tensor tracked by two stores), and held for the ranges not asked about until their own look.
The kernel itself refuses to register one page with two userfaultfds (``EBUSY``), so a second
tracker in the same process, or another userfaultfd user, cannot share a page with this one: its
range comes back unknown.

Why a write cannot be missed
----------------------------
* *The mark.* Tracking a range registers its pages (``UFFDIO_REGISTER_MODE_WP``) and write-protects
  them. A protected page table entry carries the userfaultfd write-protect bit (an unpopulated one,
  a marker with it). The first write to such a page faults; in asynchronous mode the kernel
  clears the bit itself and lets the write go on, with no thread of ours involved. Every write
  that goes through this process's page tables takes that fault: any thread's store, the kernel
  copying into the page (``read``, ``readinto``), another process writing through
  ``process_vm_writev``, the copy-on-write after a ``fork``. A page whose bit
  is clear counts as written, whatever cleared it.
* *The scan.* ``PAGEMAP_SCAN`` with ``PM_SCAN_WP_MATCHING`` reports each written page and sets its
  bit again under the page table's lock, then flushes the TLB, in the same call: a write either
  lands before the page is reported (and is reported) or faults afterwards (and is reported by the
  next look). When the output array fills, the kernel stops at ``walk_end`` before protecting the
  next written page; the scan goes on from there until the run's end, so a page is protected
  again only if it was reported.
* *New ranges.* A range is protected by that same scan rather than by ``UFFDIO_WRITEPROTECT``, and
  what the scan finds on pages shared with ranges already tracked is credited to them: tracking
  a tensor never clears the evidence of a write to its neighbour on the same page. Its own pending
  set starts empty: a look reports writes since :meth:`~WrittenPages.track` (track first, then
  read the bytes).
* *Memory that changed identity.* A range whose memory was unmapped, or unmapped and mapped again
  (``p.data = other`` freeing a large tensor, ``MAP_FIXED``, ``mremap``), is no longer registered,
  and a scan of it would find nothing written. Each look therefore checks each run: ``msync(MS_ASYNC)``
  fails with ``ENOMEM`` when part of it is unmapped (a scan silently skips holes, even with
  ``PM_SCAN_CHECK_WPASYNC``), and the scan, with ``PM_SCAN_CHECK_WPASYNC``, fails with ``EPERM`` on a
  mapping not registered for asynchronous write-protection. Either way a scan of the pages' write
  permission (``PAGE_IS_WPALLOWED``) names the ranges affected; they come back ``None`` and are no
  longer tracked (track them again). The pages the failed scan had reported and protected before
  it stopped are not lost: the kernel copies their entries out before returning the error, and a
  zeroed output array tells how many; the rest of the run is scanned again without the check.
* *Forks.* A child does not inherit the registration (the kernel drops it without
  ``UFFD_FEATURE_EVENT_FORK``), and its inherited descriptors still point at the parent: its
  pagemap descriptor would scan, and protect, the *parent's* pages. So a tracker made before a
  fork answers ``None`` for everything in the child, without a system call (the process id is
  checked on each call, and a fork handler closes the inherited descriptors);
  :func:`for_this_process` makes the child a tracker of its own. The parent's tracking is
  unaffected: its own copy-on-write faults are writes like any other.

What it cannot see
------------------
* Memory that others can write: a mapping shared with another process (``share_memory_()``, a
  ``/dev/shm`` file, ``MAP_SHARED``) or a file's pages (``mmap``-loaded weights) changes without a
  fault in this process. :meth:`~WrittenPages.track` refuses every range that is not private
  anonymous memory (``/proc/self/maps``).
* Writes through a pin taken before the protection: a device's DMA into page-locked memory (a
  CUDA copy into a ``pin_memory()`` tensor), ``O_DIRECT`` or ``io_uring`` reads in flight across a
  look, RDMA. They write the physical page, not through the page table. Do not track page-locked
  tensors.
* Pages given back with ``MADV_DONTNEED`` (or ``MADV_FREE``, once the kernel took them back) read as zeros
  afterwards, and on Linux 6.18 the scan does not report them. Allocators do this only to memory
  they hold free, never under a live tensor.
* The tracker tracks addresses, not tensors. Memory freed and reused at the same address within a
  mapping that stays (the heap) is tracked on: the new owner's writes are reported, its earlier
  ones are not. A caller checks that the tensor's storage is still the one it tracked (its data
  pointer) before it trusts an answer.

Limits
------
Registering a range splits the mapping it lies in at the ends of its run (the pieces of one run
merge back into one mapping), and a process may hold at most ``vm.max_map_count`` mappings, past
which its allocations fail. A tracker therefore holds at most :data:`MAX_RUNS` runs (and no more
than an eighth of ``vm.max_map_count``), at most :data:`MAX_RANGES` ranges, and starts no run more
once the process's mappings, two more for each new run, would pass half of ``vm.max_map_count``.
A range past a bound is not tracked (its :attr:`~TrackedRange.unknown` says why), and the caller
copies it. :meth:`~WrittenPages.untrack` unregisters the pages no range holds any more, and the
mapping merges back.

Cost
----
A look costs one ``msync`` and one ``PAGEMAP_SCAN`` per run it covers, plus the scan's walk of the
page tables; the first write to each protected page, a fault. Measured with
``benchmarks/written_pages_bench.py`` on a 2-core x86-64 VM under Linux 6.18, shared with other
work (load 4 to 5), medians of 50:

* a look over 128 MiB (one run) with nothing written: 0.043 ms; with 4 MiB written: 0.10 ms;
* a look over 256 runs of 64 KiB, nothing written: 1.15 ms (4.5 us a run); tracking them: 9 ms;
* the first write after a look: 4 MiB in 1.2 ms against 0.06 ms for the same write again (1.1 us
  a 4 KiB page); all 128 MiB in 96 ms against 9 ms (2.7 us a page, the page tables out of cache).

So protect what is expected to stay unchanged: a tensor rewritten every step pays the fault on
each of its pages every step.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import mmap
import os
import platform
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Sequence

from shmsync.errors import ArgumentTypeError, InvalidArgumentError, WriteTrackingError

PAGE = mmap.PAGESIZE
ENV = "SHMSYNC_WRITE_TRACKING"  # "0" turns write tracking off

# linux/userfaultfd.h (upstream; Debian's linux-libc-dev 6.1 lacks the asynchronous mode).
UFFD_API = 0xAA
UFFD_USER_MODE_ONLY = 1  # a flag of the userfaultfd system call: faults of user code only
UFFD_FEATURE_WP_UNPOPULATED = 1 << 13
UFFD_FEATURE_WP_ASYNC = 1 << 15
UFFDIO_REGISTER_MODE_WP = 1 << 1
# linux/fs.h (upstream, 6.7+).
PAGE_IS_WPALLOWED = 1 << 0
PAGE_IS_WRITTEN = 1 << 1
PAGE_IS_FILE = 1 << 2
PAGE_IS_PRESENT = 1 << 3
PM_SCAN_WP_MATCHING = 1 << 0
PM_SCAN_CHECK_WPASYNC = 1 << 1
MS_ASYNC = 1  # sys/mman.h

# The userfaultfd system call's number where the ioctl numbers below are encoded as in
# asm-generic/ioctl.h (elsewhere tracking is reported unavailable).
USERFAULTFD_SYSCALL = {"x86_64": 323, "aarch64": 282, "riscv64": 282}

MAX_RUNS = 4096  # runs of tracked pages per process: each may split a mapping at both ends
MAX_RANGES = 1 << 16  # tracked ranges per process
_ADDRESS_LIMIT = 1 << 63  # above: the kernel's half of the address space, on every machine above


class UffdioApi(ctypes.Structure):
    """``struct uffdio_api``: the handshake, the features asked for and granted."""

    _fields_ = [("api", ctypes.c_uint64), ("features", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class UffdioRange(ctypes.Structure):
    """``struct uffdio_range``."""

    _fields_ = [("start", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class UffdioRegister(ctypes.Structure):
    """``struct uffdio_register``."""

    _fields_ = [("range", UffdioRange), ("mode", ctypes.c_uint64), ("ioctls", ctypes.c_uint64)]


class PageRegion(ctypes.Structure):
    """``struct page_region``: one run of pages of the same categories, ``[start, end)``."""

    _fields_ = [("start", ctypes.c_uint64), ("end", ctypes.c_uint64), ("categories", ctypes.c_uint64)]


class PmScanArg(ctypes.Structure):
    """``struct pm_scan_arg``: what ``PAGEMAP_SCAN`` scans, and where the walk stopped."""

    _fields_ = [
        (name, ctypes.c_uint64)
        for name in (
            "size",
            "flags",
            "start",
            "end",
            "walk_end",
            "vec",
            "vec_len",
            "max_pages",
            "category_inverted",
            "category_mask",
            "category_anyof_mask",
            "return_mask",
        )
    ]


def _ioc(direction: int, kind: int, number: int, struct: type[ctypes.Structure]) -> int:
    """An ioctl number as asm-generic/ioctl.h's ``_IOC`` makes it (direction 2: read, 3: both)."""
    return (direction << 30) | (ctypes.sizeof(struct) << 16) | (kind << 8) | number


UFFDIO_API = _ioc(3, UFFD_API, 0x3F, UffdioApi)
UFFDIO_REGISTER = _ioc(3, UFFD_API, 0x00, UffdioRegister)
UFFDIO_UNREGISTER = _ioc(2, UFFD_API, 0x01, UffdioRange)
PAGEMAP_SCAN = _ioc(3, ord("f"), 16, PmScanArg)

Spans = list[tuple[int, int]]  # (offset within the range, length), sorted, apart


class TrackedRange:
    """A byte range of this process's memory that a :class:`WrittenPages` was asked to track.

    ``address`` and ``length`` are as given; ``pages_start`` and ``pages_end`` the pages it lies on
    (rounded outward). ``unknown`` is ``None`` while it is tracked; otherwise why not, for a
    caller to report (refused when tracking began, its memory unmapped since, untracked, the
    tracker closed or left behind by a fork): :meth:`WrittenPages.look` answers ``None`` for it.
    """

    __slots__ = ("address", "length", "pages_start", "pages_end", "unknown")

    def __init__(self, address: int, length: int) -> None:
        self.address = address
        self.length = length
        self.pages_start = address - address % PAGE
        self.pages_end = -(-(address + length) // PAGE) * PAGE
        self.unknown: str | None = None

    def __repr__(self) -> str:
        state = "tracked" if self.unknown is None else f"unknown: {self.unknown}"
        return f"TrackedRange({self.address:#x}, {self.length}, {state})"


class _Run:
    """Tracked pages without a gap: the pages of overlapping or adjacent ranges, scanned whole."""

    __slots__ = ("start", "end", "ranges")

    def __init__(self, start: int, end: int, ranges: list[TrackedRange]) -> None:
        self.start, self.end, self.ranges = start, end, ranges


_libc_handle: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    """The C library, loaded on first use (never at import: elsewhere than Linux it may differ)."""
    global _libc_handle
    if _libc_handle is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        libc.ioctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p]
        libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc_handle = libc
    return _libc_handle


def _ioctl(fd: int, request: int, struct: ctypes.Structure) -> int:
    """``ioctl(fd, request, &struct)``: its result, or ``-errno``."""
    result = int(_libc().ioctl(fd, request, ctypes.addressof(struct)))
    return -ctypes.get_errno() if result < 0 else result


def _merged(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[start, end)`` intervals, sorted, with overlapping and adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def _refusal(err: int) -> str:
    """Why the userfaultfd system call failed with ``err``, for a person to act on."""
    release = platform.release()
    if err in (errno.EPERM, errno.EACCES):
        return (
            "the kernel refused the userfaultfd system call to this process (EPERM): a seccomp filter "
            "(container runtimes' default profiles refuse it) or a policy forbids it"
        )
    if err == errno.ENOSYS:
        return "this kernel has no userfaultfd system call (built without CONFIG_USERFAULTFD, or filtered)"
    if err == errno.EINVAL:
        return f"Linux {release} does not take UFFD_USER_MODE_ONLY (5.11 or later; write tracking needs 6.7)"
    return f"the userfaultfd system call failed: {os.strerror(err)}"


class _Kernel:
    """This process's userfaultfd and ``/proc/self/pagemap`` descriptors, and the calls on them."""

    def __init__(self, regions: int) -> None:
        libc = _libc()
        wanted = UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED
        flags = os.O_CLOEXEC | os.O_NONBLOCK | UFFD_USER_MODE_ONLY
        uffd = int(libc.syscall(ctypes.c_long(USERFAULTFD_SYSCALL[platform.machine()]), ctypes.c_long(flags)))
        if uffd < 0:
            raise WriteTrackingError(_refusal(ctypes.get_errno()))
        try:
            api = UffdioApi(api=UFFD_API, features=wanted)
            if _ioctl(uffd, UFFDIO_API, api) < 0 or api.features & wanted != wanted:
                raise WriteTrackingError(
                    f"Linux {platform.release()} lacks asynchronous write-protection "
                    "(UFFD_FEATURE_WP_ASYNC, Linux 6.7 or later)"
                )
            try:
                pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as e:
                raise WriteTrackingError(f"/proc/self/pagemap cannot be opened ({e.strerror})") from None
        except BaseException:
            os.close(uffd)
            raise
        self.uffd, self.pagemap = uffd, pagemap
        self.vec = (PageRegion * regions)()
        # One argument per category asked about: pages written, and pages registered.
        self.args = {
            category: PmScanArg(
                size=ctypes.sizeof(PmScanArg),
                vec=ctypes.addressof(self.vec),
                vec_len=regions,
                category_mask=category,
                return_mask=category,
            )
            for category in (PAGE_IS_WRITTEN, PAGE_IS_WPALLOWED)
        }
        self.used = 0  # entries of vec that may not be zero
        self.ioctl, self.msync = libc.ioctl, libc.msync

    def close(self) -> None:
        """Close both descriptors (the kernel unregisters every range with the last reference)."""
        for fd in (self.uffd, self.pagemap):
            try:
                os.close(fd)
            except OSError:  # closed already (a fork handler's close, then this one's)
                pass

    def register(self, start: int, end: int) -> int:
        """Register ``[start, end)`` for asynchronous write-protection: 0, or ``-errno``."""
        request = UffdioRegister(range=UffdioRange(start, end - start), mode=UFFDIO_REGISTER_MODE_WP)
        return min(0, _ioctl(self.uffd, UFFDIO_REGISTER, request))

    def unregister(self, start: int, end: int) -> None:
        """Give back ``[start, end)``, which no tracked range holds any more. Best effort: the pages
        may be unmapped or someone else's by now, and pages left registered only cost a fault."""
        _ioctl(self.uffd, UFFDIO_UNREGISTER, UffdioRange(start, end - start))

    def scan(self, start: int, end: int, flags: int, category: int) -> tuple[list[tuple[int, int]], int]:
        """The regions of ``[start, end)`` in ``category``, the output array refilled until the
        walk reaches ``end``; and 0, or the ``errno`` that stopped it (the regions then are those
        the kernel reported before it stopped)."""
        arg, vec, found = self.args[category], self.vec, []
        arg.flags, arg.end = flags, end
        while start < end:
            if self.used:  # zeroed, so that what an error leaves there can be counted
                ctypes.memset(vec, 0, self.used * ctypes.sizeof(PageRegion))
            arg.start, arg.walk_end = start, 0
            n = int(self.ioctl(self.pagemap, PAGEMAP_SCAN, ctypes.addressof(arg)))
            if n < 0:
                err, self.used = ctypes.get_errno(), len(vec)
                found += [(r.start, r.end) for r in vec if r.end > r.start]
                return found, err
            self.used = n
            found += [(vec[i].start, vec[i].end) for i in range(n)]
            if arg.walk_end <= start:
                raise WriteTrackingError(f"PAGEMAP_SCAN made no progress at {start:#x}", errno.EIO)
            start = arg.walk_end
        return found, 0

    def written(self, start: int, end: int) -> tuple[list[tuple[int, int]], bool]:
        """The pages of ``[start, end)`` written since they were last protected, protected again;
        and whether all of ``[start, end)`` is still mapped and registered (if not, the pages found
        are those of the parts that are).

        Raises:
            WriteTrackingError: the scan failed otherwise (``errno`` says why).
        """
        intact = self.msync(start, end - start, MS_ASYNC) == 0  # ENOMEM: a hole, which scans skip
        found, err = self.scan(start, end, PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC, PAGE_IS_WRITTEN)
        if err == errno.EPERM:  # a mapping not registered; go on past it without the check
            rest, err = self.scan(start, end, PM_SCAN_WP_MATCHING, PAGE_IS_WRITTEN)
            found, intact = found + rest, False
        if err:
            raise WriteTrackingError(f"PAGEMAP_SCAN failed on {start:#x}-{end:#x}: {os.strerror(err)}", err)
        return (_merged(found) if found else found), intact

    def registered(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` mapped and registered for asynchronous write-protection
        (a slower walk: each page is looked at)."""
        found, err = self.scan(start, end, 0, PAGE_IS_WPALLOWED)
        if err:
            raise WriteTrackingError(f"PAGEMAP_SCAN failed on {start:#x}-{end:#x}: {os.strerror(err)}", err)
        return _merged(found)

    def self_test(self) -> str | None:
        """Protect four pages of fresh memory, write one, and scan twice: exactly that page, then
        none. ``None`` when so; otherwise what went wrong."""
        block = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            block.write(b"\1" * len(block))
            start = _address_of(block)
            err = -self.register(start, start + len(block))
            if err:
                return f"the kernel refused to register anonymous memory for write-protection ({os.strerror(err)})"
            try:
                self.written(start, start + len(block))
                block[PAGE + 5] = 7
                first, _ = self.written(start, start + len(block))
                second, _ = self.written(start, start + len(block))
            except WriteTrackingError as e:
                if e.errno in (errno.ENOTTY, errno.EINVAL):
                    return f"Linux {platform.release()} lacks the PAGEMAP_SCAN ioctl (Linux 6.7 or later)"
                return str(e)
            if first != [(start + PAGE, start + 2 * PAGE)] or second:
                return (
                    f"the kernel failed the write-tracking self-test: one page written, reported "
                    f"{sum(e - s for s, e in first) // PAGE} pages, then {sum(e - s for s, e in second) // PAGE}"
                )
            return None
        finally:
            block.close()


def _address_of(block: mmap.mmap) -> int:
    anchor = ctypes.c_char.from_buffer(block)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # the export would keep the mapping from closing


class _Mappings:
    """This process's memory mappings, as ``/proc/self/maps`` listed them once."""

    def __init__(self) -> None:
        with open("/proc/self/maps", "rb") as f:
            lines = f.read().splitlines()
        self.count = len(lines)
        self.rows: list[tuple[int, int, bytes]] = []
        for line in lines:
            fields = line.split(maxsplit=5)
            low, high = fields[0].split(b"-")
            private_anonymous = fields[1][3:4] == b"p" and fields[4] == b"0" and _anonymous(fields[5:])
            self.rows.append((int(low, 16), int(high, 16), b"" if private_anonymous else line))
        self.starts = [row[0] for row in self.rows]

    def why_not_private_anonymous(self, start: int, end: int) -> str | None:
        """Why ``[start, end)`` is not wholly private anonymous memory, or ``None``."""
        i = bisect.bisect_right(self.starts, start) - 1
        at = start
        while at < end:
            if i < 0 or i >= len(self.rows) or not self.rows[i][0] <= at < self.rows[i][1]:
                return f"{at:#x} is not mapped"
            if self.rows[i][2]:
                what = self.rows[i][2].decode(errors="replace")
                return (
                    f"not private anonymous memory ({what!r}): another process, or a file, could change it "
                    "without a write of this process"
                )
            at = self.rows[i][1]
            i += 1
        return None


def _anonymous(name: list[bytes]) -> bool:
    """Whether a mapping's name (in /proc/self/maps) is one of anonymous memory's."""
    return not name or name[0] in (b"[heap]", b"[stack]") or name[0].startswith(b"[anon:")


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return max(0, int(f.read()))
    except (OSError, ValueError):
        return 65530  # the kernel's default


class WrittenPages:
    """The pages of this process's memory written since each tracked range's last look.

    One per process is enough (:func:`for_this_process`, argued in :mod:`this module's notes
    <shmsync.core.written_pages>`): it tracks any number of ranges, of any number of stores.

    Args:
        regions_per_scan: the length of the output array of one ``PAGEMAP_SCAN`` call (a scan
            goes on past a full array, so this only trades memory for calls).

    Raises:
        WriteTrackingError: write tracking is unavailable here (:func:`unavailable_reason`).

    ``max_runs`` is the most runs of tracked pages it keeps (:data:`MAX_RUNS`, or an eighth of
    ``vm.max_map_count`` if less); a range that would start one more is not tracked.

    Examples:
        >>> import ctypes, mmap
        >>> block = mmap.mmap(-1, 4 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        >>> address = ctypes.addressof(ctypes.c_char.from_buffer(block))
        >>> try:
        ...     pages = WrittenPages()
        ... except WriteTrackingError:  # not Linux 6.7+, or turned off: copy everything instead
        ...     pages = None
        >>> if pages is not None:
        ...     (weights,) = pages.track([(address + 100, 2 * mmap.PAGESIZE)])
        ...     assert pages.look([weights]) == [[]]  # nothing written since track
        ...     block[mmap.PAGESIZE + 1] = 7  # a byte on the range's second page
        ...     assert pages.look([weights]) == [[(mmap.PAGESIZE - 100, mmap.PAGESIZE)]]
        ...     assert pages.look([weights]) == [[]]
        ...     pages.close()
        >>> block.close()
    """

    def __init__(self, regions_per_scan: int = 256) -> None:
        if isinstance(regions_per_scan, bool) or not isinstance(regions_per_scan, int):
            raise ArgumentTypeError(f"regions_per_scan must be an int, not {type(regions_per_scan).__name__}")
        if not 1 <= regions_per_scan <= 1 << 16:
            raise InvalidArgumentError(f"regions_per_scan must be in [1, 65536], not {regions_per_scan}")
        reason = unavailable_reason()
        if reason is not None:
            raise WriteTrackingError(reason)
        self._kernel = _Kernel(regions_per_scan)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._pending: dict[TrackedRange, list[tuple[int, int]]] = {}  # the tracked ranges' written pages
        self._runs: list[_Run] = []  # sorted, apart
        self._starts: list[int] = []  # each run's start, for bisect
        self._run_of: dict[TrackedRange, _Run] = {}
        self._closed: str | None = None
        self.max_runs = min(MAX_RUNS, _max_map_count() // 8)
        self._close_descriptors = weakref.finalize(self, self._kernel.close)
        _INSTANCES.add(self)

    # -- public ----------------------------------------------------------------------------------
    def track(self, spans: Iterable[tuple[int, int]]) -> list[TrackedRange]:
        """Start tracking each ``(address, length)`` of this process's memory: a look reports the
        writes made after this call. Track, then read the bytes.

        A range that cannot be tracked is returned all the same, with its
        :attr:`~TrackedRange.unknown` saying why (not private anonymous memory, not mapped, past a
        bound, refused by the kernel): :meth:`look` answers ``None`` for it.

        Args:
            spans: ``(address, length)`` pairs, each ``length > 0``; ranges may overlap or share pages.

        Returns:
            One :class:`TrackedRange` per span, in order.

        Raises:
            ArgumentTypeError, InvalidArgumentError: a span is not two ints, or out of range
                (nothing was tracked).
            WriteTrackingError: this tracker is closed, or was made in another process (a fork's
                parent): use :func:`for_this_process`.
        """
        ranges = [TrackedRange(*_checked_span(span)) for span in spans]
        if not ranges:
            return ranges
        self._check_process()
        mappings = _Mappings()
        with self._lock:
            if self._closed is not None:
                raise WriteTrackingError(f"this write tracker is closed ({self._closed})")
            # Up to half of vm.max_map_count for the process; each run may add two mappings to it.
            room = len(self._runs) + (_max_map_count() // 2 - mappings.count) // 2
            for r in ranges:
                r.unknown = self._refusal(r, mappings, room)
                if r.unknown is None:
                    self._start(r)
        return ranges

    def look(self, ranges: Sequence[TrackedRange]) -> list[Spans | None]:
        """For each range, the bytes on pages written since its last look (or since it was
        tracked), and protect those pages again.

        Args:
            ranges: ranges this tracker returned from :meth:`track`.

        Returns:
            Per range, in order: ``(offset, length)`` spans within it, sorted and apart, covering
            the range's bytes on each written page (an empty list: no page of it was written);
            or ``None``: unknown (see its :attr:`~TrackedRange.unknown`), copy it whole. A range
            found unmapped, or whose pages a scan failed on, is no longer tracked; track it again.

        Raises:
            ArgumentTypeError: an item is not a :class:`TrackedRange`.
        """
        ranges = list(ranges)
        for r in ranges:
            if not isinstance(r, TrackedRange):
                raise ArgumentTypeError(f"look() takes TrackedRange objects from track(), not {type(r).__name__}")
        if os.getpid() != self._pid:
            self._forked()  # never touch the parent's descriptors
            return [None] * len(ranges)
        with self._lock:
            runs = {id(run): run for r in ranges if (run := self._run_of.get(r)) is not None}
            for run in sorted(runs.values(), key=lambda run: run.start):
                self._scan(list(run.ranges), run.start, run.end)
            answers: dict[TrackedRange, Spans | None] = {}
            for r in ranges:
                if r not in answers:
                    answers[r] = self._take(r)
            return [answers[r] for r in ranges]

    def untrack(self, ranges: Iterable[TrackedRange]) -> None:
        """Stop tracking these ranges (their pages that no other range holds are unprotected);
        ranges not tracked are passed over."""
        if os.getpid() != self._pid:
            self._forked()
            return
        with self._lock:
            for r in ranges:
                if r in self._pending:
                    self._lose(r, "untracked")

    def close(self) -> None:
        """Stop tracking everything and close the descriptors (idempotent)."""
        if os.getpid() != self._pid:
            self._forked()
            return
        with self._lock:
            self._end("the tracker was closed")

    @property
    def usable(self) -> bool:
        """Whether this tracker can track in this process: not closed, not inherited through a fork."""
        return self._closed is None and os.getpid() == self._pid

    # -- internal ----------------------------------------------------------------------------------
    @staticmethod
    def _after_fork_in_child() -> None:
        """``os.register_at_fork``'s hook: every tracker the parent made lets go of its descriptors
        in the child, and the child's first :func:`for_this_process` makes a tracker of its own."""
        global _shared, _shared_lock
        _shared, _shared_lock = None, threading.Lock()
        for tracker in list(_INSTANCES):
            tracker._forked()

    def _check_process(self) -> None:
        if os.getpid() != self._pid:
            self._forked()
            raise WriteTrackingError(
                f"this write tracker belongs to process {self._pid}, which this one forked from: "
                "use written_pages.for_this_process() here"
            )

    def _forked(self) -> None:
        """In a forked child: close the inherited descriptors, without the lock (a thread of the
        parent may have held it), and answer ``None`` from now on."""
        why = f"this process was forked from process {self._pid}, which tracked it"
        if self._closed is None:
            self._closed = why
        for r in list(self._pending):
            r.unknown = why
        self._close_descriptors()

    def _end(self, why: str) -> None:
        if self._closed is None:
            self._closed = why
            for r in self._pending:
                r.unknown = why
            self._pending.clear()
            self._runs, self._starts, self._run_of = [], [], {}
        self._close_descriptors()

    def _refusal(self, r: TrackedRange, mappings: _Mappings, room: int) -> str | None:
        """Why ``r`` is not to be tracked, or ``None``. ``room``: how many runs the process's
        mappings leave room for (each run may add two mappings)."""
        if len(self._pending) >= MAX_RANGES:
            return f"this process tracks {MAX_RANGES} ranges already, the most it tracks"
        why = mappings.why_not_private_anonymous(r.pages_start, r.pages_end)
        if why is not None:
            return why
        low, high = self._touching(r.pages_start, r.pages_end)
        if high > low:  # joins a run: no mapping more
            return None
        if len(self._runs) >= self.max_runs:
            return (
                f"tracking it would make {len(self._runs) + 1} runs of tracked pages, past this process's bound "
                f"of {self.max_runs} (each may split a mapping in two; vm.max_map_count is {_max_map_count()})"
            )
        if len(self._runs) >= room:
            return (
                f"this process holds {mappings.count} memory mappings, near half of vm.max_map_count "
                f"({_max_map_count()}): more could make its allocations fail"
            )
        return None

    def _touching(self, start: int, end: int) -> tuple[int, int]:
        """The runs that overlap or touch ``[start, end)``: ``self._runs[low:high]``."""
        high = bisect.bisect_right(self._starts, end)
        low = high
        while low > 0 and self._runs[low - 1].end >= start:
            low -= 1
        return low, high

    def _start(self, r: TrackedRange) -> None:
        """Register and protect ``r``'s pages, crediting what was written on them to the ranges
        that already hold some of them."""
        err = -self._kernel.register(r.pages_start, r.pages_end)
        if err:
            r.unknown = f"the kernel refused to write-protect it ({os.strerror(err)})"
            return
        low, high = self._touching(r.pages_start, r.pages_end)
        neighbours = [n for run in self._runs[low:high] for n in run.ranges]
        self._scan([*neighbours, r], r.pages_start, r.pages_end)  # r itself is credited nothing
        if r.unknown is not None:  # unmapped meanwhile, by another thread
            self._unregister_untracked(r.pages_start, r.pages_end)
            return
        self._pending[r] = []
        low, high = self._touching(r.pages_start, r.pages_end)
        run = _Run(r.pages_start, r.pages_end, [r])
        for other in self._runs[low:high]:
            run.start, run.end = min(run.start, other.start), max(run.end, other.end)
            run.ranges += other.ranges
        self._runs[low:high], self._starts[low:high] = [run], [run.start]
        for member in run.ranges:
            self._run_of[member] = run

    def _scan(self, ranges: list[TrackedRange], start: int, end: int) -> None:
        """Scan ``[start, end)`` (protecting what was written again), credit what was written to
        ``ranges``, and lose those of them no longer wholly mapped and registered; all of them if
        the scan fails (its pages may have been protected again unreported)."""
        try:
            written, intact = self._kernel.written(start, end)
            if written:
                self._credit(ranges, written)
            registered = [(start, end)] if intact else self._kernel.registered(start, end)
        except WriteTrackingError as e:
            for r in ranges:
                self._lose(r, f"a scan of its pages failed: {e}")
            return
        for r in ranges if not intact else ():
            i = bisect.bisect_right(registered, (r.pages_start, _ADDRESS_LIMIT)) - 1
            if i < 0 or registered[i][1] < r.pages_end:
                self._lose(r, "its memory was unmapped, or mapped anew, since it was tracked")

    def _credit(self, ranges: list[TrackedRange], written: list[tuple[int, int]]) -> None:
        """Add each written page interval (sorted, apart) to every tracked range it overlaps."""
        starts = [start for start, _ in written]
        for r in ranges:
            pending = self._pending.get(r)
            if pending is None:
                continue
            i = max(0, bisect.bisect_right(starts, r.pages_start) - 1)
            hits = []
            while i < len(written) and written[i][0] < r.pages_end:
                if written[i][1] > r.pages_start:
                    hits.append((max(written[i][0], r.pages_start), min(written[i][1], r.pages_end)))
                i += 1
            if hits:
                self._pending[r] = _merged(pending + hits)

    def _lose(self, r: TrackedRange, why: str) -> None:
        """Stop tracking ``r``: split its run where it leaves a gap, and unregister the gaps."""
        r.unknown = why
        self._pending.pop(r, None)
        run = self._run_of.pop(r, None)
        if run is None:
            return
        run.ranges.remove(r)
        pieces: list[_Run] = []
        for member in sorted(run.ranges, key=lambda m: m.pages_start):
            if pieces and member.pages_start <= pieces[-1].end:
                pieces[-1].end = max(pieces[-1].end, member.pages_end)
                pieces[-1].ranges.append(member)
            else:
                pieces.append(_Run(member.pages_start, member.pages_end, [member]))
        i = bisect.bisect_left(self._starts, run.start)
        self._runs[i : i + 1], self._starts[i : i + 1] = pieces, [p.start for p in pieces]
        for piece in pieces:
            for member in piece.ranges:
                self._run_of[member] = piece
        self._unregister_untracked(run.start, run.end)

    def _unregister_untracked(self, start: int, end: int) -> None:
        """Unregister the parts of ``[start, end)`` that no run holds."""
        low, high = self._touching(start, end)
        at = start
        for run in self._runs[low:high]:
            if run.start > at:
                self._kernel.unregister(at, min(run.start, end))
            at = max(at, run.end)
        if at < end:
            self._kernel.unregister(at, end)

    def _take(self, r: TrackedRange) -> Spans | None:
        """``r``'s written bytes as spans within it, forgotten once taken; ``None`` if not tracked."""
        pending = self._pending.get(r)
        if pending is None:
            if r.unknown is None:
                r.unknown = "not tracked by this tracker"
            return None
        self._pending[r] = []
        low, high = r.address, r.address + r.length
        return [(max(s, low) - low, min(e, high) - max(s, low)) for s, e in pending if s < high and e > low]


def _checked_span(span: object) -> tuple[int, int]:
    """``(address, length)``, checked: two ints, a positive length, inside the address space."""
    if not isinstance(span, tuple) or len(span) != 2:
        raise ArgumentTypeError(f"a span is an (address, length) tuple, not {span!r}")
    address, length = span
    for name, value in (("address", address), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ArgumentTypeError(f"a span's {name} must be an int, not {type(value).__name__}")
    if address <= 0 or length <= 0 or address + length > _ADDRESS_LIMIT:
        raise InvalidArgumentError(
            f"a span must have address > 0, length > 0 and end inside the address space, not ({address:#x}, {length})"
        )
    return address, length


_INSTANCES: weakref.WeakSet[WrittenPages] = weakref.WeakSet()
_shared: WrittenPages | None = None
_shared_lock = threading.Lock()
_probed: tuple[int, str | None] | None = None  # (pid, the probe's answer)
# pagemap entries: bit 63 "present", bit 61 "file page or shared anonymous". A present page of a
# private file mapping without bit 61 is this process's own copy. In each entry's top byte
# (little-endian: its 8th), those are 0x80 and 0x20.
OWN_COPY = bytes(1 if b & 0xA0 == 0x80 else 0 for b in range(256))
# This process's pagemap, and how it scans it: (pid, pagemap, ioctl or None where the kernel has
# no PAGEMAP_SCAN, argument, output). Made once per process: a reader asks at every load.
_copies: tuple[int, int, Callable[..., int] | None, PmScanArg, ctypes.Array] | None = None


def private_copies(address: int, length: int) -> int | None:
    """How many pages of ``[address, address + length)``, a private mapping of a file, are this
    process's own copies (present, and no longer the file's: written since mapped).

    One ``PAGEMAP_SCAN`` counts them where the kernel has it (Linux 6.7 and later); elsewhere
    ``/proc/self/pagemap`` is read, eight bytes a page.

    Args:
        address: the first byte of the span.
        length: its size in bytes.

    Returns:
        The count of pages, or None where ``/proc/self/pagemap`` cannot be read.

    Examples:
        >>> import mmap, tempfile
        >>> with tempfile.TemporaryFile() as f:
        ...     _ = f.truncate(4 * mmap.PAGESIZE)
        ...     block = mmap.mmap(f.fileno(), 4 * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
        ...     address = ctypes.addressof(ctypes.c_char.from_buffer(block))
        ...     block[5] = 1  # this process's own copy of the first page now
        ...     private_copies(address, 4 * mmap.PAGESIZE)
        1
    """
    global _copies
    pid = os.getpid()
    if _copies is None or _copies[0] != pid:
        try:
            fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        vec = (PageRegion * 64)()
        arg = PmScanArg(
            size=ctypes.sizeof(PmScanArg),
            vec=ctypes.addressof(vec),
            vec_len=64,
            category_mask=PAGE_IS_PRESENT | PAGE_IS_FILE,
            return_mask=PAGE_IS_PRESENT | PAGE_IS_FILE,
            category_inverted=PAGE_IS_FILE,  # present, and not the file's
        )
        _copies = (pid, fd, _libc().ioctl, arg, vec)
    _, fd, ioctl, arg, vec = _copies
    first, end = address - address % PAGE, address + length
    if ioctl is not None:
        start, pages = first, 0
        arg.end = end
        while start < end:
            arg.start, arg.walk_end = start, 0
            n = int(ioctl(fd, PAGEMAP_SCAN, ctypes.addressof(arg)))
            if n < 0 or arg.walk_end <= start:
                if n < 0 and ctypes.get_errno() in (errno.ENOTTY, errno.EINVAL):  # no PAGEMAP_SCAN here
                    _copies = (pid, fd, None, arg, vec)
                break
            pages += sum(vec[i].end - vec[i].start for i in range(n)) // PAGE
            start = arg.walk_end
        else:
            return pages
    entries = os.pread(fd, ((end - 1) // PAGE - first // PAGE + 1) * 8, first // PAGE * 8)
    return entries[7::8].translate(OWN_COPY).count(1)


def unavailable_reason() -> str | None:
    """Why write tracking is unavailable in this process, or ``None`` when it is available.

    ``SHMSYNC_WRITE_TRACKING=0`` turns it off (read on each call); otherwise the kernel is asked,
    once per process: Linux 6.7 or later with the userfaultfd system call allowed, asynchronous
    write-protection, ``PAGEMAP_SCAN``, and a self-test (four pages protected, one written: exactly
    that one reported, then none). Never raises.

    Examples:
        >>> reason = unavailable_reason()
        >>> reason is None or isinstance(reason, str)
        True
    """
    setting = os.environ.get(ENV, "").strip()
    if setting == "0":
        return f"turned off ({ENV}=0)"
    if setting not in ("", "1"):
        return f"{ENV}={setting!r} is neither 0 (off) nor 1 (on): off until it is one of them"
    global _probed
    if _probed is None or _probed[0] != os.getpid():
        _probed = (os.getpid(), _probe())
    return _probed[1]


def _probe() -> str | None:
    if not sys.platform.startswith("linux"):
        return f"write tracking needs Linux 6.7 or later; this is {sys.platform}"
    if platform.machine() not in USERFAULTFD_SYSCALL:
        return f"write tracking is not built for {platform.machine()} (only {', '.join(USERFAULTFD_SYSCALL)})"
    try:
        kernel = _Kernel(regions=4)
    except WriteTrackingError as e:
        return str(e)
    except OSError as e:  # the C library could not be loaded
        return f"write tracking could not start: {e}"
    try:
        return kernel.self_test()
    finally:
        kernel.close()


def for_this_process() -> WrittenPages:
    """This process's tracker, made on first use (a forked child gets its own).

    Returns:
        The :class:`WrittenPages` every caller in this process shares.

    Raises:
        WriteTrackingError: write tracking is unavailable here (the message says why).

    Examples:
        >>> try:
        ...     pages = for_this_process()
        ... except WriteTrackingError as e:
        ...     pages = None  # copy everything; str(e) says why
        >>> pages is None or pages is for_this_process()
        True
    """
    global _shared
    reason = unavailable_reason()
    if reason is not None:
        raise WriteTrackingError(reason)
    with _shared_lock:
        if _shared is None or not _shared.usable:
            _shared = WrittenPages()
        return _shared


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=WrittenPages._after_fork_in_child)
