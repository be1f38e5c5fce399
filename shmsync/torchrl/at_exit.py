"""At interpreter exit: the collectors that still hold shmsync stores because nobody shut them down.

A script whose loop ends (or fails) without ``collector.shutdown()`` would otherwise hang at exit
without a word: Python's multiprocessing joins the collector's worker processes, which wait for
the trainer's next command, which never comes (TorchRL's own schemes hang the same way). So for
every such collector shmsync first prints one line on stderr, naming the collector and the fix,
then shuts it down (TorchRL's own ``shutdown()``: its workers end, its stores go), and the
script exits. Collectors without a shmsync scheme are left as TorchRL leaves them, and so are the
collectors of a remote collector's nodes (TorchRL shuts those down itself).

The check is registered with :mod:`atexit` when the first collector meets a shmsync scheme, after
multiprocessing's own exit handler (its module is imported first, below): handlers run last
registered first, so this one runs before that handler waits for any child process.
"""

from __future__ import annotations

import atexit
import inspect
import multiprocessing.util  # noqa: F401  (its exit handler, which joins child processes, is registered first)
import sys
import weakref
from typing import Any, Protocol, TextIO


class Served(Protocol):
    """What the check reads of a collector's :class:`~shmsync.torchrl.publisher.Publisher`."""

    pushes: Any  # set on a remote collector's node: TorchRL shuts that collector down itself

    @property
    def collector(self) -> Any: ...

    def live_groups(self) -> list[Any]: ...


_WATCHED: weakref.WeakSet[Any] = weakref.WeakSet()
_REGISTERED: list[bool] = []  # one atexit registration per process


def watch(publisher: Served) -> None:
    """Check ``publisher``'s collector at interpreter exit (the check is registered once)."""
    _WATCHED.add(publisher)
    if not _REGISTERED:
        _REGISTERED.append(True)
        atexit.register(shut_down_left_running)


def left_running() -> list[Served]:
    """The publishers whose collector is alive, in this process's trainer, with stores still open."""
    return [p for p in list(_WATCHED) if p.pushes is None and p.collector is not None and p.live_groups()]


def warning(publisher: Served) -> str:
    """The line printed for ``publisher``'s collector, left running at exit: which collector (its
    name in the script, where the script's globals hold it), its stores, and the fix."""
    collector = publisher.collector
    main = sys.modules.get("__main__")
    names = [k for k, v in inspect.getmembers(main) if v is collector and k[:1].isalpha()] if main else []
    called = names[0] if names else "collector"
    stores = ", ".join(name for g in publisher.live_groups() for name in g.store_names)
    which = f"{type(collector).__name__} {called!r}" if names else f"a {type(collector).__name__}"
    return (
        f"shmsync: {which} (store {stores}) was never shut down, which would keep Python from exiting: shutting "
        f"it down now. Call {called}.shutdown() when done with it, in a try/finally around its loop."
    )


def shut_down_left_running(stream: TextIO | None = None) -> int:
    """Name each collector left running (one line on ``stream``, default stderr), then shut it down.
    Returns how many there were. Runs at interpreter exit; a failed shutdown is named, not raised.

    Examples:
        >>> shut_down_left_running()  # every collector of this process was shut down
        0
    """
    stream = stream if stream is not None else sys.stderr
    left = left_running()
    for publisher in left:
        collector = publisher.collector
        print(warning(publisher), file=stream, flush=True)
        try:
            collector.shutdown()
        except Exception as error:  # at exit there is nobody to raise to
            print(f"shmsync: {type(collector).__name__}.shutdown() failed: {error!r}", file=stream, flush=True)
    return len(left)
