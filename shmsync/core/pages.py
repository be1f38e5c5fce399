"""The pages behind a store's file: reserving them, giving them back, and telling whose they are.

A slot that no reader uses and that the writer will not write next holds no memory: its pages
are given back with ``fallocate(PUNCH_HOLE)``, and come back (zeroed) on its next write, which
reserves them first with ``posix_fallocate`` so that a full ``/dev/shm`` is a Python error, not
a SIGBUS in the middle of a copy.

Readers map the slots privately (``MAP_PRIVATE``): they read the store's own pages, shared
with every other process, and a write of theirs copies the page for them alone (it never
reaches the store: :mod:`shmsync.reader.in_place` finds and drops such copies).

No torch here: these are byte ranges of a file and of this process's address space.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os

from shmsync.errors import SharedMemoryError

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
_PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.memcmp.restype = ctypes.c_int
_libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def reserve(fd: int, offset: int, length: int, what: str) -> None:
    """Allocate the pages of ``[offset, offset + length)`` now.

    Raises:
        OSError: there is no room (naming ``what`` and how much is free in the file's folder).
    """
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as e:
        free = os.fstatvfs(fd)
        raise SharedMemoryError(
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
        raise SharedMemoryError(err, f"cannot give back shared memory: {os.strerror(err)}")


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


def same_memory(a: int, b: int, length: int) -> bool:
    """Whether the ``length`` bytes at address ``a`` equal those at ``b`` (``memcmp``: it stops at
    the first byte that differs; the GIL is released meanwhile).

    Examples:
        >>> import ctypes
        >>> x, y = ctypes.create_string_buffer(b"weights"), ctypes.create_string_buffer(b"weighty")
        >>> a, b = ctypes.addressof(x), ctypes.addressof(y)
        >>> same_memory(a, b, 6), same_memory(a, b, 7)
        (True, False)
    """
    return _libc.memcmp(a, b, length) == 0


def same_memories(ranges: list[tuple[int, int, int]]) -> list[bool]:
    """:func:`same_memory` for each ``(a, b, length)``, in one loop (a publish asks about every
    small tensor of a model: the calls in between cost more than the comparisons).

    Examples:
        >>> import ctypes
        >>> x, y = ctypes.create_string_buffer(b"weights"), ctypes.create_string_buffer(b"weighty")
        >>> a, b = ctypes.addressof(x), ctypes.addressof(y)
        >>> same_memories([(a, b, 6), (a, b, 7)])
        [True, False]
    """
    memcmp = _libc.memcmp
    return [memcmp(a, b, length) == 0 for a, b, length in ranges]


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
