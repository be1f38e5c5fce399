"""The kernel's interface for written pages (shmsync/core/page_map.py): the structures and ioctl
numbers are the upstream headers', and the count of a process's own copies of a file's pages is the
one /proc/self/pagemap gives entry by entry. What the tracker built on it reports is
tests/core/test_written_pages.py's."""

from __future__ import annotations

import ctypes
import mmap

from shmsync.core import page_map
from shmsync.core.page_map import (
    OWN_COPY,
    PAGEMAP_SCAN,
    UFFDIO_API,
    UFFDIO_REGISTER,
    UFFDIO_UNREGISTER,
    PageRegion,
    PmScanArg,
    UffdioApi,
    UffdioRange,
    UffdioRegister,
    private_copies,
)


def test_the_structures_and_ioctl_numbers_are_the_upstream_headers():
    """linux/userfaultfd.h and linux/fs.h (6.7+): sizes, the offsets the kernel writes back, and the
    ioctl numbers those headers' _IOWR/_IOR make on x86-64 and arm64."""
    assert [ctypes.sizeof(s) for s in (UffdioApi, UffdioRange, UffdioRegister, PageRegion, PmScanArg)] == [
        24,
        16,
        32,
        24,
        96,
    ]
    assert (PmScanArg.walk_end.offset, PmScanArg.vec.offset, PmScanArg.return_mask.offset) == (32, 40, 88)
    assert (UffdioRegister.mode.offset, UffdioRegister.ioctls.offset, UffdioApi.features.offset) == (16, 24, 8)
    assert (UFFDIO_API, UFFDIO_REGISTER, UFFDIO_UNREGISTER, PAGEMAP_SCAN) == (
        0xC018AA3F,
        0xC020AA00,
        0x8010AA01,
        0xC0606610,
    )
    assert (page_map.UFFD_FEATURE_WP_ASYNC, page_map.UFFD_FEATURE_WP_UNPOPULATED) == (1 << 15, 1 << 13)
    assert (page_map.PAGE_IS_WPALLOWED, page_map.PAGE_IS_WRITTEN) == (1, 2)
    assert (page_map.PM_SCAN_WP_MATCHING, page_map.PM_SCAN_CHECK_WPASYNC) == (1, 2)


def test_private_copies_counts_the_pages_this_process_wrote_in_a_private_file_mapping(tmp_path):
    """What a reader in place asks before its parameters leave a slot: the pages of its private
    mapping of the store that are its own copies, in one scan; the same count as reading
    /proc/self/pagemap entry by entry."""
    pages = 300
    path = tmp_path / "slot"
    path.write_bytes(bytes(pages * mmap.PAGESIZE))
    with open(path, "r+b") as f:
        block = mmap.mmap(f.fileno(), pages * mmap.PAGESIZE, flags=mmap.MAP_PRIVATE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(block))
    assert private_copies(address, pages * mmap.PAGESIZE) == 0
    for page in (0, 7, 8, 9, 299):
        block[page * mmap.PAGESIZE + 11] = 1
    _ = block[50 * mmap.PAGESIZE]  # read: the file's page, mapped, not a copy
    found = private_copies(address + 100, pages * mmap.PAGESIZE - 200)
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(address // mmap.PAGESIZE * 8)
        entries = pagemap.read(pages * 8)
    assert found == entries[7::8].translate(OWN_COPY).count(1) == 5
