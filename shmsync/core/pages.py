"""The pages behind a store's file: reserving them, giving them back, and telling whose they are.

A slot that no reader uses and that the writer will not write next holds no memory: its pages
are given back with ``fallocate(PUNCH_HOLE)``, and come back (zeroed) on its next write, which
reserves them first with ``posix_fallocate`` so that a full ``/dev/shm`` is a Python error, not
a SIGBUS in the middle of a copy.

Readers map the slots privately (``MAP_PRIVATE``): they read the store's own pages, shared
with every other process, and a write of theirs copies the page for them alone (it never
reaches the store). :func:`private_pages` counts such copies through ``/proc/self/pagemap``,
and :func:`discard_private` drops them, so that the mapping shows the store's pages again.

No torch here: these are byte ranges of a file and of this process's address space.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE
# pagemap entries: bit 63 "present", bit 61 "file page or shared anonymous". A present page
# of a private file mapping without bit 61 is this process's own copy. In each entry's top
# byte (little-endian: its 8th), those are 0x80 and 0x20.
_OWN_COPY = bytes(1 if b & 0xA0 == 0x80 else 0 for b in range(256))

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_pagemap: int | None = None
_pagemap_pid = 0


def reserve(fd: int, offset: int, length: int, what: str) -> None:
    """Allocate the pages of ``[offset, offset + length)`` now.

    Raises:
        OSError: there is no room (naming ``what`` and how much is free in the file's folder).
    """
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        free = os.fstatvfs(fd)
        raise OSError(
            e.errno,
            f"cannot reserve {human_bytes(length)} for {what} ({e.strerror}; "
            f"{human_bytes(free.f_bavail * free.f_frsize)} free in its shared-memory folder); free shared "
            "memory (`shmsync gc`), or enlarge it",
        ) from None


def punch(fd: int, offset: int, length: int) -> None:
    """Give back the pages of ``[offset, offset + length)``: they read as zeros afterwards, and
    every mapping of them, in every process, lets go of them (private copies excepted)."""
    if _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"cannot give back shared memory: {os.strerror(err)}")


def holds_pages(fd: int, offset: int, length: int) -> bool:
    """Whether any page of ``[offset, offset + length)`` is allocated (one ``lseek``)."""
    try:
        return os.lseek(fd, offset, os.SEEK_DATA) < offset + length
    except OSError as e:
        if e.errno == errno.ENXIO:  # no data past offset
            return False
        raise


def resident_bytes(fd: int) -> int:
    """Bytes of memory the file's pages take now (its reservation may be larger)."""
    return os.fstat(fd).st_blocks * 512


def address_of(buffer: mmap.mmap) -> int:
    """The address of a writable mapping's first byte in this process."""
    anchor = ctypes.c_char.from_buffer(buffer)
    try:
        return ctypes.addressof(anchor)
    finally:
        del anchor  # the export would keep the mapping from closing


def private_pages(address: int, length: int) -> int | None:
    """How many pages of ``[address, address + length)`` (a private file mapping of this
    process) are this process's own copies, written since mapped; None if ``/proc/self/pagemap``
    cannot be read here."""
    global _pagemap, _pagemap_pid
    if _pagemap is None or _pagemap_pid != os.getpid():
        try:
            _pagemap, _pagemap_pid = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC), os.getpid()
        except OSError:
            return None
    first, last = address // _PAGE, (address + length - 1) // _PAGE
    entries = os.pread(_pagemap, (last - first + 1) * 8, first * 8)
    return entries[7::8].translate(_OWN_COPY).count(1)


def discard_private(address: int, length: int) -> None:
    """Drop this process's own copies of pages in ``[address, address + length)`` (a private file
    mapping): the mapping shows the file's pages again."""
    start = address - address % _PAGE
    if _libc.madvise(start, address + length - start, MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise(MADV_DONTNEED) failed: {os.strerror(err)}")


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
