"""What write tracking costs (shmsync/core/written_pages.py): a look over a large range with nothing
and with a little written, a look over many small runs, tracking itself, and the fault the first
write to each protected page takes, beside the same write to pages already written.

    python benchmarks/written_pages_bench.py            # 128 MiB, 4 MiB written, 256 runs of 64 KiB
    python benchmarks/written_pages_bench.py --quick

Each figure is the median of ``--repeat`` runs in one process (the memory is private anonymous
memory of its own, so no other allocation writes to its pages). Needs Linux 6.7 or later; says
why and exits otherwise.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import platform
import statistics
import sys
import time

from shmsync.core.written_pages import WrittenPages, for_this_process, unavailable_reason

MIB = 1 << 20


def private_memory(nbytes: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping of ``nbytes``, written once (so its pages exist), and its address."""
    block = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(block)
    address = ctypes.addressof(anchor)
    del anchor
    ctypes.memset(address, 1, nbytes)
    return block, address


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def look_costs(pages: WrittenPages, total: int, written: int, repeat: int) -> dict[str, float]:
    """One range of ``total`` bytes: a look with nothing written, a look after ``written`` bytes
    were, and the write itself protected (right after a look) and unprotected (written again)."""
    block, address = private_memory(total)
    (whole,) = pages.track([(address, total)])
    clean, dirty, first_write, second_write = [], [], [], []
    for i in range(repeat):
        t0 = time.perf_counter()
        assert pages.look([whole]) == [[]]
        clean.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ctypes.memset(address, i, written)
        first_write.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ctypes.memset(address, i + 1, written)
        second_write.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        assert pages.look([whole]) == [[(0, written)]]
        dirty.append(time.perf_counter() - t0)
    pages.untrack([whole])
    block.close()
    return {
        "clean": median_ms(clean),
        "dirty": median_ms(dirty),
        "fault_us_per_page": (median_ms(first_write) - median_ms(second_write)) * 1e3 / (written // mmap.PAGESIZE),
        "first_write": median_ms(first_write),
        "second_write": median_ms(second_write),
    }


def whole_update(pages: WrittenPages, total: int, repeat: int) -> tuple[float, float]:
    """Every byte of ``total`` written, right after a look (each page faults once) and again (none
    does): an in-place update of a tensor the trainer rewrites every step."""
    block, address = private_memory(total)
    (whole,) = pages.track([(address, total)])
    protected, unprotected = [], []
    for i in range(repeat):
        pages.look([whole])
        t0 = time.perf_counter()
        ctypes.memset(address, i, total)
        protected.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ctypes.memset(address, i + 1, total)
        unprotected.append(time.perf_counter() - t0)
    pages.untrack([whole])
    block.close()
    return median_ms(protected), median_ms(unprotected)


def many_runs(pages: WrittenPages, runs: int, each: int, repeat: int) -> dict[str, float]:
    """``runs`` ranges of ``each`` bytes with a page between each two (so each is a run of its
    own): tracking them, and a look with nothing written."""
    stride = each + mmap.PAGESIZE
    block, address = private_memory(runs * stride)
    t0 = time.perf_counter()
    ranges = pages.track([(address + i * stride, each) for i in range(runs)])
    track = time.perf_counter() - t0
    assert all(r.unknown is None for r in ranges), [r.unknown for r in ranges if r.unknown][:1]
    looks = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        assert not any(pages.look(ranges))
        looks.append(time.perf_counter() - t0)
    pages.untrack(ranges)
    block.close()
    return {"track": track * 1e3, "look": median_ms(looks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=128, help="the large range, in MiB")
    parser.add_argument("--written-mib", type=int, default=4, help="what is written of it between two looks")
    parser.add_argument("--runs", type=int, default=256, help="how many small ranges, each its own run")
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="16 MiB, 1 MiB written, 16 runs, 5 repeats")
    args = parser.parse_args()
    if args.quick:
        args.mib, args.written_mib, args.runs, args.repeat = 16, 1, 16, 5
    reason = unavailable_reason()
    if reason is not None:
        sys.exit(f"write tracking is unavailable here: {reason}")
    pages = for_this_process()
    try:
        big = look_costs(pages, args.mib * MIB, args.written_mib * MIB, args.repeat)
        small = many_runs(pages, args.runs, 64 * 1024, args.repeat)
        update = whole_update(pages, args.mib * MIB, max(3, args.repeat // 10))
    finally:
        pages.close()
    print(f"Linux {platform.release()} {platform.machine()}, median of {args.repeat}\n")
    print("| what | ms |")
    print("|---|---|")
    print(f"| look, {args.mib} MiB, nothing written | {big['clean']:.3f} |")
    print(f"| look, {args.mib} MiB, {args.written_mib} MiB written | {big['dirty']:.3f} |")
    print(f"| write {args.written_mib} MiB, pages protected | {big['first_write']:.3f} |")
    print(f"| write {args.written_mib} MiB again, pages written | {big['second_write']:.3f} |")
    print(f"| write all {args.mib} MiB, pages protected | {update[0]:.3f} |")
    print(f"| write all {args.mib} MiB again, pages written | {update[1]:.3f} |")
    print(f"| track {args.runs} ranges of 64 KiB, one run each | {small['track']:.3f} |")
    print(f"| look, {args.runs} runs of 64 KiB, nothing written | {small['look']:.3f} |")
    page_kib = mmap.PAGESIZE // 1024
    print(f"\nthe first write to a protected page: {big['fault_us_per_page']:.2f} us a {page_kib} KiB page")


if __name__ == "__main__":
    main()
