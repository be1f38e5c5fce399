"""Pytest fixtures for multi-process suites that use shmsync (loaded automatically as a plugin),
and fault injection: what a crashed, stuck or hostile process does to a store, on purpose.

* ``store_factory``: makes stores with unique names and removes them after the test,
  however it ends.
* ``shm_leak_check``: fails a test that leaves behind a store created by its own process
  or by one of its children, or a live child process.
* :func:`write_header_word`, :func:`read_header_word`, :func:`header_bytes`: a header as another
  process of this user (another PID namespace, a bug) could leave it.
* :func:`stop_mid_publish`: a writer that dies in the middle of a copy.
* :func:`read_with`: a reader whose copy runs ``copy(slot, views)`` (slow, stuck, stopped),
  optimistic or pinned.
* :func:`hold_table_lock`: a reader stopped while it changes the reader table.
* :func:`slot_views`, :func:`ordering_of`, :func:`page_locked`: what a store's mapping holds.

Examples:
    A test of a user's project::

        def test_workers_see_new_weights(store_factory, shm_leak_check):
            store = store_factory(torch.nn.Linear(4, 2))
            ...

    or, to check every test of a suite, in ``conftest.py``::

        @pytest.fixture(autouse=True)
        def _no_leaks(shm_leak_check):
            yield
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from shmsync.core import segment
from shmsync.core.header import MAGIC, W_CREATOR_PID, W_CREATOR_PPID, W_MAGIC
from shmsync.core.protocol import Leases, SlotWriter
from shmsync.errors import ShmSyncError


def stores_created_by(pids: set[int]) -> set[str]:
    """Names of the stores on this host whose creator, or the creator's parent, is in ``pids``."""
    out = set()
    for name in segment.list_names():
        try:
            found = segment.peek(name, 8 * 32)
        except ShmSyncError:
            continue  # not a file this user made
        if found is None or len(found[0]) < 8 * 32:
            continue
        h = memoryview(found[0]).cast("q")
        if h[W_MAGIC] == MAGIC and (h[W_CREATOR_PID] in pids or h[W_CREATOR_PPID] in pids):
            out.add(name)
    return out


# Stores that a live store_factory will remove at its own teardown, which may come after the
# leak check's (fixtures tear down in reverse order of request).
_MANAGED: set[str] = set()

# Long-lived helpers that multiprocessing starts once per process on purpose.
_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _runs_helper(p: psutil.Process | None) -> bool:
    try:
        return p is not None and any(h in " ".join(p.cmdline()) for h in _HELPERS)
    except psutil.Error:
        return False


def _is_helper(p: psutil.Process) -> bool:
    """Whether ``p`` is one of multiprocessing's helpers itself. A forkserver's children run the
    same command line (they are forked from it) but are the processes it started: not helpers."""
    try:
        return _runs_helper(p) and not _runs_helper(p.parent())
    except psutil.Error:
        return False


def _descendants() -> tuple[list[psutil.Process], set[int]]:
    """This process's live descendants but multiprocessing's helpers, and those helpers' pids: one
    walk of the process tree."""
    live, helpers = [], set()
    for p in psutil.Process().children(recursive=True):
        try:
            if _is_helper(p):
                helpers.add(p.pid)
            elif p.status() != psutil.STATUS_ZOMBIE:
                live.append(p)
        except psutil.Error:
            pass
    return live, helpers


def helper_pids() -> set[int]:
    """The pids of multiprocessing's helpers among this process's descendants (a forkserver is the
    parent of the processes it starts: a store one of them created names it as the creator's parent)."""
    return _descendants()[1]


def live_children() -> list[psutil.Process]:
    """Live descendants of this process, except multiprocessing's own helpers (the processes a
    forkserver started count)."""
    return _descendants()[0]


@pytest.fixture
def store_factory() -> Iterator[Callable[..., Any]]:
    """``store_factory(source, **kwargs)`` -> a new :class:`~shmsync.WeightStore`, removed after the test."""
    from shmsync.writer.store import WeightStore  # here, not at import: the plugin loads in every pytest run

    made: list[WeightStore] = []

    def make(source: Any, **kwargs: Any) -> WeightStore:
        store = WeightStore.create(source, **kwargs)
        made.append(store)
        _MANAGED.add(store.name)
        return store

    yield make
    for store in made:
        store.unlink()
        store.close()
        _MANAGED.discard(store.name)


@pytest.fixture
def shm_leak_check() -> Iterator[None]:
    """Fails the test if it leaves a store of its own process tree, or a child process, behind.

    Children get up to 10 seconds to exit; any left are killed so the next test starts clean.
    Stores made by ``store_factory`` are its to remove, whatever order the fixtures come in.
    """
    me = os.getpid()
    live, helpers = _descendants()
    before_children = {p.pid for p in live}
    tree = {me} | before_children | helpers
    before = stores_created_by(tree)
    yield
    extra, collected = _children_left(before_children)
    # Stores whose creator died are only found through the creator's parent (us, a forkserver) or pid set.
    pids = tree | _descendants()[1] | {p.pid for p in extra}
    leaked = stores_created_by(pids) - before - _MANAGED
    if leaked and not collected:
        gc.collect()
        leaked = stores_created_by(pids) - before - _MANAGED
    for name in leaked:
        segment.unlink(name)
    problems = []
    if leaked:
        problems.append(f"shared-memory stores left behind: {sorted(leaked)}")
    if extra:
        problems.append(f"child processes left running: {[(p.pid, _cmd(p)) for p in extra]}")
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


def _children_left(before: set[int]) -> tuple[list[psutil.Process], bool]:
    """The child processes a test left running after 10 seconds (killed), and whether a garbage
    collection ran meanwhile. A collection (a few tenths of a second with torch loaded) runs only
    when something is left: a child still running after half a second may wait on a pipe end held
    in a reference cycle, and a store left may be one the test dropped inside a cycle."""
    collected = False
    start = time.monotonic()
    while True:
        extra = [p for p in live_children() if p.pid not in before]
        if not extra or time.monotonic() > start + 10:
            break
        if not collected and time.monotonic() > start + 0.5:
            gc.collect()
            collected = True
        time.sleep(0.05)
    for p in extra:
        p.kill()
    return extra, collected


def _cmd(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())[:120]
    except psutil.Error:
        return "?"


# -- fault injection ------------------------------------------------------------------------------
def read_header_word(store: Any, word: int) -> int:
    """Header word ``word`` (a ``shmsync.core.header.W_*`` index) of ``store`` as mapped here."""
    return int(store.memory.header[word])


def write_header_word(store: Any, word: int, value: int) -> None:
    """Write header word ``word`` of ``store``, as a process of this user (a bug, another PID
    namespace) could: everything that reads it must cope."""
    store.memory.header[word] = value


def header_bytes(store: Any) -> bytes:
    """A copy of ``store``'s whole header, to compare before and after."""
    from .core.header import HEADER_BYTES

    return bytes(store.memory.segment.buf[:HEADER_BYTES])


def stop_mid_publish(store: Any, fill: float = -1.0) -> int:
    """Start a publish into ``store`` and stop halfway through its copy (half the tensors of the
    slot filled with ``fill``, the slot marked being written), as a writer killed there leaves
    it; returns the slot. The write stays open in this process: kill it next."""
    store.flush()  # the give-backs after the last publish first: none may touch the slot it marks
    memory = store.memory
    write = SlotWriter(memory.host, Leases(memory.host, memory.locks)).begin_write()
    views = memory.map_slots()[write.slot]
    for view in views[: len(views) // 2]:
        view.fill_(fill)
    return write.slot


def read_with(
    store: Any,
    copy: Callable[[int, list[Any]], None],
    *,
    pinned: bool = False,
    timeout: float = 60.0,
    steal_after: float = 0.25,
) -> int:
    """Load ``store``'s newest complete version through ``copy(slot, views)`` (``views``: that
    slot's tensors, in layout order), by the protocol a reader follows (``pinned``: at once by
    its bounded fallback, as a reader slower than the writer does; ``steal_after``: seconds before
    it looks whether the reader holding the token is stopped); returns the version."""
    slots = store.memory.map_slots()

    def run(slot: int) -> None:
        copy(slot, slots[slot])

    if pinned:
        return store.slot_reader.read_pinned(run, time.monotonic() + timeout, steal_after=steal_after)
    return store.slot_reader.read(run, timeout=timeout)


@contextlib.contextmanager
def hold_table_lock(store: Any) -> Iterator[None]:
    """Hold ``store``'s reader-table lock (through this mapping), as a reader stopped in the middle
    of a lease would."""
    with store.memory.locks.table(None):
        yield


def slot_views(store: Any, private: bool = False) -> list[list[Any]]:
    """Per slot, a view of every tensor of ``store`` (``private``: a reader's private mapping's)."""
    return store.memory.private_slots() if private else store.memory.map_slots()


def ordering_of(store: Any) -> str:
    """``"tso"`` or ``"weak"``: the memory ordering ``store``'s protocol runs with here."""
    words = store.memory.host
    return "weak" if words.fence is words.full_fence else "tso"


def page_locked(store: Any) -> bool:
    """Whether ``store``'s slots are page-locked (``cudaHostRegister``) in this process."""
    return store.memory.page_locked
