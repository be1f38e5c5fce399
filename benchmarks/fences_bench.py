"""What a memory fence and a header word cost, side by side: the fences shmsync can use, the one it
used to build from machine code written at run time, and a header word read through a memoryview
against a C11 atomic load.

    python benchmarks/fences_bench.py          # a few seconds
    python benchmarks/fences_bench.py --docs   # also writes docs/results/fences_bench.md
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import platform
import statistics
import sys
import timeit
from pathlib import Path

# The code this benchmark's results measure (benchmarks/provenance.py).
MEASURES = ["benchmarks/fences_bench.py", "shmsync/core/fences.py", "shmsync/core/_atomics.c"]

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def per_call(fn, number: int = 200_000, repeat: int = 7) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number


def machine_code_fence():
    """The fence as shmsync built it before: ``mfence; ret`` written into a page made executable."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    page.write(b"\x0f\xae\xf0\xc3")
    address = ctypes.addressof(ctypes.c_char.from_buffer(page))
    if libc.mprotect(address, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
        return None
    fn = ctypes.CFUNCTYPE(None)(address)
    fn._page = page
    return fn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", action="store_true")
    args = parser.parse_args(argv)
    from shmsync.core import fences

    rows = []
    for name, fn in (
        ("compiled C11 fence (shmsync.core._atomics, the default)", fences._extension_fence()),
        ("libatomic's atomic_thread_fence, through ctypes", fences._libatomic_fence()),
        ("before: machine code written at run time, through ctypes", machine_code_fence()),
        ("membarrier(2)", fences._membarrier_fence()),
        ("a lock round trip (x86 only)", fences._lock_round_trip),
        ("no fence (a Python call)", fences._noop),
    ):
        rows.append((name, per_call(fn, 200 if "membarrier" in name else 200_000) if fn is not None else None))
    words = memoryview(bytearray(4096)).cast("q")
    from shmsync.core import _atomics

    access = [
        ("header word through a memoryview (the default)", per_call(lambda: words[2])),
        ("header word through the C11 atomic load", per_call(lambda: _atomics.load_word(words, 2))),
    ]
    lines = [f"{platform.machine()}, Python {platform.python_version()}", "", "| fence | per call |", "|---|---|"]
    lines += [f"| {n} | {'n/a' if t is None else f'{t * 1e9:.0f} ns'} |" for n, t in rows]
    lines += ["", "| header access | per read |", "|---|---|"]
    lines += [f"| {n} | {t * 1e9:.0f} ns |" for n, t in access]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.docs:
        from provenance import write

        write("fences_bench", text, MEASURES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
