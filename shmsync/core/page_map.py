"""The kernel's interface for knowing which pages of this process's memory were written (no torch
here): userfaultfd's asynchronous write-protection and ``PAGEMAP_SCAN`` on ``/proc/self/pagemap``
(their structures and ioctl numbers, the system calls, and a self-test), ``/proc/self/maps``, and
the one scan loop every question asks through (:class:`Scan`): the pages written since they were
protected (:class:`PageMap`, for :mod:`shmsync.core.written_pages`' tracker), and this process's
own copies of a file's pages (:func:`private_copies`, for a reader in place).

Linux 6.7 and later have all of it; Debian bookworm's ``linux-libc-dev`` (6.1) lacks the
constants, so they are taken from the upstream uapi headers (``linux/userfaultfd.h``,
``linux/fs.h``) and checked in a test.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import mmap
import os
import platform
from collections.abc import Iterable

from shmsync.core.pages import address_of
from shmsync.errors import WriteTrackingError

PAGE = mmap.PAGESIZE

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


def merged(intervals: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
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


class Scan:
    """One kind of ``PAGEMAP_SCAN`` question on a pagemap descriptor: the regions of a span whose
    pages are in ``category`` (with ``inverted``, those whose pages are not in the bits it names),
    the output array refilled until the walk reaches the span's end. The one scan loop of this
    module: the tracker's looks and a reader's count of its own pages go through it.

    Args:
        fd: ``/proc/self/pagemap``, open.
        category: the ``PAGE_IS_*`` bits asked about.
        inverted: those of them asked about as absent.
        regions: the length of the output array (a scan goes on past a full array, so this only
            trades memory for calls).
    """

    def __init__(self, fd: int, category: int, inverted: int = 0, regions: int = 256) -> None:
        self.fd, self.vec = fd, (PageRegion * regions)()
        self.arg = PmScanArg(
            size=ctypes.sizeof(PmScanArg),
            vec=ctypes.addressof(self.vec),
            vec_len=regions,
            category_mask=category,
            return_mask=category,
            category_inverted=inverted,
        )
        self.address = ctypes.addressof(self.arg)
        self.ioctl = _libc().ioctl
        self.used = 0  # entries of vec that may not be zero

    def __call__(self, start: int, end: int, flags: int = 0) -> tuple[list[tuple[int, int]], int]:
        """The regions of ``[start, end)`` in the category; and 0, or the ``errno`` that stopped
        the walk (the regions then are those the kernel reported before it stopped)."""
        arg, vec, found = self.arg, self.vec, []
        arg.flags, arg.end = flags, end
        while start < end:
            if self.used:  # zeroed, so that what an error leaves there can be counted
                ctypes.memset(vec, 0, self.used * ctypes.sizeof(PageRegion))
            arg.start, arg.walk_end = start, 0
            n = int(self.ioctl(self.fd, PAGEMAP_SCAN, self.address))
            if n < 0:
                err, self.used = ctypes.get_errno(), len(vec)
                found += [(r.start, r.end) for r in vec if r.end > r.start]
                return found, err
            self.used = n
            if n:
                found += [(vec[i].start, vec[i].end) for i in range(n)]
            if arg.walk_end <= start:
                raise WriteTrackingError(f"PAGEMAP_SCAN made no progress at {start:#x}", errno.EIO)
            start = arg.walk_end
        return found, 0


class PageMap:
    """This process's userfaultfd and ``/proc/self/pagemap`` descriptors, and the calls on them:
    registering ranges for asynchronous write-protection, and asking which of their pages were
    written (protecting them again).

    Args:
        regions: the length of a scan's output array.

    Raises:
        WriteTrackingError: the kernel refused the userfaultfd system call, or lacks asynchronous
            write-protection, or ``/proc/self/pagemap`` cannot be opened.
    """

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
        # The two questions asked: pages written (protected again as reported), pages registered.
        self.written_pages = Scan(pagemap, PAGE_IS_WRITTEN, 0, regions)
        self.registered_pages: Scan | None = None  # made at its first use (a scan found a range not registered)
        self.regions = regions
        self.msync = libc.msync

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

    def written(self, start: int, end: int) -> tuple[list[tuple[int, int]], bool]:
        """The pages of ``[start, end)`` written since they were last protected, protected again;
        and whether all of ``[start, end)`` is still mapped and registered (if not, the pages found
        are those of the parts that are).

        Raises:
            WriteTrackingError: the scan failed otherwise (``errno`` says why).
        """
        intact = self.msync(start, end - start, MS_ASYNC) == 0  # ENOMEM: a hole, which scans skip
        found, err = self.written_pages(start, end, PM_SCAN_WP_MATCHING | PM_SCAN_CHECK_WPASYNC)
        if err == errno.EPERM:  # a mapping not registered; go on past it without the check
            rest, err = self.written_pages(start, end, PM_SCAN_WP_MATCHING)
            found, intact = found + rest, False
        if err:
            raise WriteTrackingError(f"PAGEMAP_SCAN failed on {start:#x}-{end:#x}: {os.strerror(err)}", err)
        return (merged(found) if found else found), intact

    def registered(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` mapped and registered for asynchronous write-protection
        (a slower walk: each page is looked at)."""
        if self.registered_pages is None:
            self.registered_pages = Scan(self.pagemap, PAGE_IS_WPALLOWED, 0, self.regions)
        found, err = self.registered_pages(start, end)
        if err:
            raise WriteTrackingError(f"PAGEMAP_SCAN failed on {start:#x}-{end:#x}: {os.strerror(err)}", err)
        return merged(found)

    def self_test(self) -> str | None:
        """Protect four pages of fresh memory, write one, and scan twice: exactly that page, then
        none. ``None`` when so; otherwise what went wrong."""
        block = mmap.mmap(-1, 4 * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            block.write(b"\1" * len(block))
            start = address_of(block)
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


class Mappings:
    """This process's memory mappings, as ``/proc/self/maps`` listed them once."""

    def __init__(self) -> None:
        with open("/proc/self/maps", "rb") as f:
            lines = f.read().splitlines()
        self.count = len(lines)
        self.rows: list[tuple[int, int, bytes]] = []
        for line in lines:
            fields = line.split(maxsplit=5)
            low, high = fields[0].split(b"-")
            private_anonymous = fields[1][3:4] == b"p" and fields[4] == b"0" and anonymous(fields[5:])
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


def anonymous(name: list[bytes]) -> bool:
    """Whether a mapping's name (in /proc/self/maps) is one of anonymous memory's."""
    return not name or name[0] in (b"[heap]", b"[stack]") or name[0].startswith(b"[anon:")


def max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return max(0, int(f.read()))
    except (OSError, ValueError):
        return 65530  # the kernel's default


# pagemap entries: bit 63 "present", bit 61 "file page or shared anonymous". A present page of a
# private file mapping without bit 61 is this process's own copy. In each entry's top byte
# (little-endian: its 8th), those are 0x80 and 0x20.
OWN_COPY = bytes(1 if b & 0xA0 == 0x80 else 0 for b in range(256))
# This process's pagemap and how it counts its own copies there: (pid, pagemap, the scan, or None
# where the kernel has no PAGEMAP_SCAN). Made once per process: a reader asks at every load.
_copies: tuple[int, int, Scan | None] | None = None


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
    if _copies is None or _copies[0] != os.getpid():
        try:
            fd = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        # Present, and not the file's: this process's own copies.
        _copies = (os.getpid(), fd, Scan(fd, PAGE_IS_PRESENT | PAGE_IS_FILE, inverted=PAGE_IS_FILE, regions=64))
    _, fd, scan = _copies
    first, end = address - address % PAGE, address + length
    if scan is not None:
        try:
            found, err = scan(first, end)
        except WriteTrackingError:  # no progress: read the entries instead
            found, err = [], errno.EIO
        if not err:
            return sum(e - s for s, e in found) // PAGE
        if err in (errno.ENOTTY, errno.EINVAL):  # no PAGEMAP_SCAN here: read the entries from now on
            _copies = (os.getpid(), fd, None)
    entries = os.pread(fd, ((end - 1) // PAGE - first // PAGE + 1) * 8, first // PAGE * 8)
    return entries[7::8].translate(OWN_COPY).count(1)
