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
import os
import platform
import sys
import threading
import weakref
from collections.abc import Iterable, Sequence

from shmsync.core.page_map import (
    PAGE,
    USERFAULTFD_SYSCALL,
    Mappings,
    PageMap,
    max_map_count,
    merged,
)
from shmsync.errors import ArgumentTypeError, InvalidArgumentError, WriteTrackingError

ENV = "SHMSYNC_WRITE_TRACKING"  # "0" turns write tracking off

MAX_RUNS = 4096  # runs of tracked pages per process: each may split a mapping at both ends
MAX_RANGES = 1 << 16  # tracked ranges per process
_ADDRESS_LIMIT = 1 << 63  # above: the kernel's half of the address space, on every machine above


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
        self._page_map = PageMap(regions_per_scan)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._pending: dict[TrackedRange, list[tuple[int, int]]] = {}  # the tracked ranges' written pages
        self._runs: list[_Run] = []  # sorted, apart
        self._starts: list[int] = []  # each run's start, for bisect
        self._run_of: dict[TrackedRange, _Run] = {}
        self._closed: str | None = None
        self.max_runs = min(MAX_RUNS, max_map_count() // 8)
        self._close_descriptors = weakref.finalize(self, self._page_map.close)
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
        mappings = Mappings()
        with self._lock:
            if self._closed is not None:
                raise WriteTrackingError(f"this write tracker is closed ({self._closed})")
            # Up to half of vm.max_map_count for the process; each run may add two mappings to it.
            room = len(self._runs) + (max_map_count() // 2 - mappings.count) // 2
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

    def _refusal(self, r: TrackedRange, mappings: Mappings, room: int) -> str | None:
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
                f"of {self.max_runs} (each may split a mapping in two; vm.max_map_count is {max_map_count()})"
            )
        if len(self._runs) >= room:
            return (
                f"this process holds {mappings.count} memory mappings, near half of vm.max_map_count "
                f"({max_map_count()}): more could make its allocations fail"
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
        err = -self._page_map.register(r.pages_start, r.pages_end)
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
            written, intact = self._page_map.written(start, end)
            if written:
                self._credit(ranges, written)
            registered = [(start, end)] if intact else self._page_map.registered(start, end)
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
                self._pending[r] = merged(pending + hits)

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
                self._page_map.unregister(at, min(run.start, end))
            at = max(at, run.end)
        if at < end:
            self._page_map.unregister(at, end)

    def _take(self, r: TrackedRange) -> Spans | None:
        """``r``'s written bytes as spans within it, forgotten once taken; ``None`` if not tracked."""
        pending = self._pending.get(r)
        if not pending:  # the common answer: nothing written (or not tracked)
            if pending is None and r.unknown is None:
                r.unknown = "not tracked by this tracker"
            return None if pending is None else []
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
        kernel = PageMap(regions=4)
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
