"""Memory fences between the protocol's word stores and loads and the bulk copies.

Two orderings are supported, chosen by the CPU (or forced with ``SHMSYNC_ORDERING``):

``"tso"`` (x86-64, i386): stores become visible in program order and loads are not
    reordered with other loads, which is all the protocol needs except between a store and
    a later load (the lease handshake). :func:`ordering` gives a no-op ``fence`` and, as
    ``full_fence``, ``mfence`` (or, where code cannot be made executable, a lock round trip,
    whose locked instruction is a full barrier on x86).
``"weak"`` (aarch64, ppc64le, and any other CPU): both are a real full barrier
    (``dmb ish`` on aarch64, ``sync`` on POWER, ``mfence`` on x86-64), run from a few bytes
    of machine code made executable once per process; if that is not allowed, the
    ``membarrier(2)`` system call, which is a full barrier on every CPU of the host (slower,
    about a microsecond to a millisecond). Without either, no store can be opened.

``SHMSYNC_ORDERING=weak`` forces the second path on x86-64, so both run in the test suite.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import threading
from collections.abc import Callable

Fence = Callable[[], None]

_MACHINE = platform.machine().lower()
_TSO = _MACHINE in ("x86_64", "amd64", "i386", "i686")

# A full barrier followed by a return, per CPU.
_CODE = {
    "x86_64": b"\x0f\xae\xf0\xc3",  # mfence; ret
    "amd64": b"\x0f\xae\xf0\xc3",
    "aarch64": (0xD5033BBF).to_bytes(4, "little") + (0xD65F03C0).to_bytes(4, "little"),  # dmb ish; ret
    "arm64": (0xD5033BBF).to_bytes(4, "little") + (0xD65F03C0).to_bytes(4, "little"),
    "ppc64le": (0x7C0004AC).to_bytes(4, "little") + (0x4E800020).to_bytes(4, "little"),  # sync; blr
}
_SYS_MEMBARRIER = {"x86_64": 324, "aarch64": 283, "arm64": 283, "ppc64le": 365, "riscv64": 283}
_MEMBARRIER_CMD_GLOBAL = 1

_LOCK = threading.Lock()
_weak_fence: Fence | None = None


def _noop() -> None:
    pass


def _lock_round_trip() -> None:
    with _LOCK:
        pass


def _machine_code_fence() -> tuple[Fence, object] | None:
    """A callable running the full-barrier instruction, and the mapping to keep alive."""
    code = _CODE.get(_MACHINE)
    if code is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        page.write(code)
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        if libc.mprotect(address, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_EXEC) != 0:
            return None  # W^X policies may forbid it
        if not _TSO:
            try:  # instruction and data caches are not coherent on every CPU
                clear = ctypes.CDLL("libgcc_s.so.1").__clear_cache
                clear.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
                clear(address, address + len(code))
            except (OSError, AttributeError):
                pass  # the kernel syncs the caches when a page turns executable (arm64)
        return ctypes.CFUNCTYPE(None)(address), page
    except (OSError, ValueError, AttributeError):
        return None


def _membarrier_fence() -> Fence | None:
    number = _SYS_MEMBARRIER.get(_MACHINE)
    if number is None:
        return None
    try:
        syscall = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    if syscall(number, 0, 0) < 0 or not syscall(number, 0, 0) & _MEMBARRIER_CMD_GLOBAL:  # QUERY
        return None

    def fence() -> None:
        syscall(number, _MEMBARRIER_CMD_GLOBAL, 0)

    return fence


def _weak() -> Fence:
    """The real full fence of this machine, built on first use."""
    global _weak_fence
    if _weak_fence is None:
        built = _machine_code_fence()
        if built is not None:
            fn, page = built
            _weak_fence = fn
            _weak_fence._page = page  # type: ignore[attr-defined]  # the code must stay mapped
        else:
            fence = _membarrier_fence()
            if fence is None:
                raise RuntimeError(
                    f"shmsync cannot order memory on this {platform.machine()} CPU: neither a barrier instruction "
                    "nor the membarrier system call is available here"
                )
            _weak_fence = fence
    return _weak_fence


def default_ordering() -> str:
    """``"tso"`` or ``"weak"``: this CPU's, unless ``SHMSYNC_ORDERING`` says otherwise."""
    forced = os.environ.get("SHMSYNC_ORDERING", "").strip().lower()
    if forced:
        if forced not in ("tso", "weak"):
            raise ValueError(f"SHMSYNC_ORDERING must be 'tso' or 'weak', got {forced!r}")
        if forced == "tso" and not _TSO:
            raise ValueError(f"SHMSYNC_ORDERING=tso is wrong on this {platform.machine()} CPU: it reorders stores")
        return forced
    return "tso" if _TSO else "weak"


def ordering(kind: str | None = None) -> tuple[Fence, Fence]:
    """``(fence, full_fence)`` for ``kind`` (default: :func:`default_ordering`).

    ``fence`` orders stores with stores and loads with loads (the seqlock's needs);
    ``full_fence`` also orders a store before a later load (the lease handshake).

    Examples:
        >>> fence, full_fence = ordering("weak")
        >>> fence(), full_fence()
        (None, None)
    """
    kind = default_ordering() if kind is None else kind
    if kind == "tso":
        try:
            return _noop, _weak()
        except RuntimeError:
            return _noop, _lock_round_trip
    if kind == "weak":
        fence = _weak()
        return fence, fence
    raise ValueError(f"ordering must be 'tso' or 'weak', got {kind!r}")
