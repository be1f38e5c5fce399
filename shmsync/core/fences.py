"""Memory fences between the protocol's word stores and loads and the bulk copies.

Two orderings are supported, chosen by the CPU (or forced with ``SHMSYNC_ORDERING``):

``"tso"`` (x86-64, i386): stores become visible in program order and loads are not reordered
    with other loads, which is all the protocol needs except between a store and a later load
    (the lease handshake). :func:`ordering` gives, as ``fence``, a compiler barrier (no
    instruction; the extension's, else a Python no-op) and, as ``full_fence``, a sequentially
    consistent fence (``mfence``).
``"weak"`` (aarch64, ppc64le, any other CPU): both are that full fence (``dmb ish`` on aarch64,
    ``sync`` on POWER), as the exhaustive checker's weak model assumes.

The full fence comes from a vetted source, the first of these found:

1. ``shmsync.core._atomics``, a few lines of C built with the package:
   ``atomic_thread_fence(memory_order_seq_cst)`` from the compiler's C11 atomics;
2. GCC's ``libatomic`` (``atomic_thread_fence``), through ctypes;
3. the ``membarrier(2)`` system call, a full barrier on every CPU of the host (slower: about a
   microsecond to a millisecond);
4. on a TSO CPU only, a lock round trip (its locked instruction is a full barrier on x86).

No executable memory is written at run time, so systems that forbid it (SELinux ``execmem``,
Linux's memory-deny-write-execute) run shmsync as any other. :func:`source` names the one in use;
``SHMSYNC_ORDERING=weak`` forces the weak path on x86-64, so both run in the test suite.

Header words are read and written as aligned 8-byte words through a ``memoryview``: on x86-64 and
aarch64 an aligned 8-byte access is a single, single-copy-atomic instruction, and the memoryview's
is as cheap as a load can be from Python (``benchmarks/fences_bench.py`` sets it against the C
atomic load, ``load_word``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import os
import platform
import threading
from collections.abc import Callable
from typing import Any

from shmsync.errors import InvalidArgumentError, ShmSyncError

Fence = Callable[[], None]

_MACHINE = platform.machine().lower()
_TSO = _MACHINE in ("x86_64", "amd64", "i386", "i686")

_SYS_MEMBARRIER = {"x86_64": 324, "aarch64": 283, "arm64": 283, "ppc64le": 365, "riscv64": 283}
_MEMBARRIER_CMD_GLOBAL = 1
_SEQ_CST = 5  # memory_order_seq_cst, as GCC numbers it

_LOCK = threading.Lock()
_full: tuple[Fence, str] | None = None


def _noop() -> None:
    pass


def _lock_round_trip() -> None:
    with _LOCK:
        pass


def _extension() -> Any:
    """The optional C extension (built by setup.py), or None."""
    try:
        return importlib.import_module("shmsync.core._atomics")
    except ImportError:  # built without a compiler: the next source
        return None


def _extension_fence() -> Fence | None:
    atomics = _extension()
    return None if atomics is None else atomics.full_fence


def _compiler_fence() -> Fence:
    """The TSO ``fence``: the extension's compiler barrier (a C call, no instruction), else a no-op."""
    atomics = _extension()
    return _noop if atomics is None else atomics.compiler_fence


def _libatomic_fence() -> Fence | None:
    name = ctypes.util.find_library("atomic") or "libatomic.so.1"
    try:
        fn = ctypes.CDLL(name).atomic_thread_fence
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], None

    def fence() -> None:
        fn(_SEQ_CST)

    return fence


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


def _full_fence() -> tuple[Fence, str]:
    """This machine's full fence and where it comes from, found on first use."""
    global _full
    if _full is None:
        for name, find in (
            ("extension", _extension_fence),
            ("libatomic", _libatomic_fence),
            ("membarrier", _membarrier_fence),
        ):
            fence = find()
            if fence is not None:
                _full = (fence, name)
                break
        else:
            if not _TSO:
                raise ShmSyncError(
                    f"shmsync cannot order memory on this {platform.machine()} CPU: its compiled fence, libatomic "
                    "and the membarrier system call are all missing (reinstall shmsync with a C compiler)"
                )
            _full = (_lock_round_trip, "lock")
    return _full


def source() -> str:
    """Where this process's full fence comes from: ``"extension"``, ``"libatomic"``,
    ``"membarrier"`` or ``"lock"`` (see the module's docstring).

    Examples:
        >>> source() in ("extension", "libatomic", "membarrier", "lock")
        True
    """
    return _full_fence()[1]


def default_ordering() -> str:
    """``"tso"`` or ``"weak"``: this CPU's, unless ``SHMSYNC_ORDERING`` says otherwise."""
    forced = os.environ.get("SHMSYNC_ORDERING", "").strip().lower()
    if forced:
        if forced not in ("tso", "weak"):
            raise InvalidArgumentError(f"SHMSYNC_ORDERING must be 'tso' or 'weak', got {forced!r}")
        if forced == "tso" and not _TSO:
            raise InvalidArgumentError(
                f"SHMSYNC_ORDERING=tso is wrong on this {platform.machine()} CPU: it reorders stores"
            )
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
    if kind not in ("tso", "weak"):
        raise InvalidArgumentError(f"ordering must be 'tso' or 'weak', got {kind!r}")
    full, _ = _full_fence()
    return (_compiler_fence() if kind == "tso" else full), full
