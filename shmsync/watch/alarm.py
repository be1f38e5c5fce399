"""The stale-reader alarm: a reader that falls behind or freezes is named once, and again when it
recovers or goes.

A reader is *stale* once it has stayed at a version older than the newest publish for
``stale_after`` seconds (it loaded nothing newer since the alarm first saw it behind), or fell
``max_lag`` or more versions behind, while it runs: a reader that says it is waiting for work
between rollouts (a collector's idle worker, see :meth:`~shmsync.WeightReader.set_waiting`)
runs no weights, and is named only if its process is stopped. A reader that merely is in the
middle of a rollout catches up at its next policy call, long before ``stale_after``; to be
named, a reader must be found stale at two checks in a row, so a reader seen halfway through
starting a rollout is not.

The alarm reads the readers' table (:mod:`shmsync.store.reader_table`) on a thread of its own, twice a
second: no message to any reader, nothing on the publish path. What it does with a stale reader
is ``on_stale``'s choice: log a warning (``"warn"``, the default; logger ``shmsync.alarm``),
log it and raise :class:`~shmsync.errors.StaleReaderError` at the trainer's next publish
(``"raise"``), or call a function with a :class:`StaleEvent` (in the alarm's thread).

Examples:
    >>> import torch
    >>> from shmsync import WeightReader, WeightStore
    >>> from shmsync.watch.alarm import ReaderAlarm
    >>> policy = torch.nn.Linear(4, 2)
    >>> with WeightStore.create(policy) as store:
    ...     reader = WeightReader(store, torch.nn.Linear(4, 2), worker=3)
    ...     _ = reader.poll()
    ...     _ = store.publish(policy)  # the reader does not poll again: it falls behind
    ...     alarm = ReaderAlarm(store.readers, stale_after=1.0, on_stale=lambda e: None)
    ...     _ = alarm.check(now=0.0), alarm.check(now=1.0)  # stale at the second check, named at the third
    ...     for event in alarm.check(now=1.5):
    ...         print(event.message)  # doctest: +ELLIPSIS
    worker 3 (pid ... on ...) of store '...' is 1 version behind (loaded 0, newest 1) for 1.5 s; its process is running
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shmsync.core.processes import process_state
from shmsync.errors import InvalidArgumentError, StaleReaderError, warn_deprecated
from shmsync.store.reader_table import HOST, STOPPED, ReaderRow, ReaderTable

log = logging.getLogger("shmsync.alarm")

STALE_AFTER = 30.0  # default seconds behind before a running reader is named
TICK = 0.5  # seconds between two checks


@dataclass(frozen=True)
class StaleEvent:
    """What the alarm found about one reader.

    Attributes:
        kind: ``"stale"`` (it fell behind or froze), ``"recovered"`` (it loaded the newest
            version since) or ``"gone"`` (it left the table while stale).
        row: its row in the readers' table when found.
        version: the store's newest complete version then.
        behind_for_s: how long it had been behind.
        message: the log line.
    """

    kind: str
    row: ReaderRow
    version: int
    behind_for_s: float
    message: str

    @property
    def latest(self) -> int:
        """Deprecated: :attr:`version` (renamed in 0.3.0, removed in 0.4.0)."""
        warn_deprecated("StaleEvent.latest", "StaleEvent.version", "0.4.0")
        return self.version


class ReaderAlarm:
    """Watches a readers' table and names stale readers (see the module's docstring).

    Args:
        table: returns the table to watch (say, ``store.readers``).
        stale_after: seconds a running reader may stay at a version older than the newest publish
            (loading nothing newer) before it is named (None: no limit).
        max_lag: versions a running reader may fall behind (None: no limit). Versions are the
            trainer's numbers: set it when they count publishes.
        on_stale: ``"warn"`` (log a warning), ``"raise"`` (log it, and raise
            :class:`~shmsync.errors.StaleReaderError` at :meth:`raise_pending`: the trainer's
            next publish) or a function called with each :class:`StaleEvent`.

    Attributes:
        stopped: True until :meth:`start`, and again after :meth:`stop` (or once the table could
            no longer be read).

    Raises:
        ValueError: a limit out of range, or an unknown ``on_stale``.
    """

    def __init__(
        self,
        table: Callable[[], ReaderTable],
        *,
        stale_after: float | None = STALE_AFTER,
        max_lag: int | None = None,
        on_stale: str | Callable[[StaleEvent], Any] = "warn",
    ) -> None:
        check_settings(stale_after, max_lag, on_stale)
        self.table = table
        self.stale_after = stale_after
        self.max_lag = max_lag
        self.on_stale = on_stale
        self.pending: StaleReaderError | None = None
        self._since: dict[tuple, tuple[int, float]] = {}  # reader -> (its version, when first seen behind at it)
        self._suspect: set[tuple] = set()  # found stale at the last check, not named yet
        self._named: dict[tuple, ReaderRow] = {}
        self._lock = threading.Lock()
        self.stopped = True  # until start()

    @property
    def stale(self) -> list[ReaderRow]:
        """The readers named stale and not recovered yet."""
        return list(self._named.values())

    def check(self, now: float | None = None) -> list[StaleEvent]:
        """Read the table once and act on what changed; returns the events (``now``:
        ``time.monotonic()`` by default)."""
        now = time.monotonic() if now is None else now
        table = self.table()
        events: list[StaleEvent] = []
        with self._lock:
            seen: set[tuple] = set()
            suspect: set[tuple] = set()
            for row in table.rows:
                key = (row.store, row.host, row.pid, row.worker)
                seen.add(key)
                if row.behind == 0:
                    since = self._since.pop(key, (row.version, now))[1]
                    if key in self._named:
                        del self._named[key]
                        events.append(self._event("recovered", row, table.version, now - since))
                    continue
                version, since = self._since.get(key, (None, now))
                if version != row.version:  # it loaded something since: behind at this version from now on
                    since = now
                    self._since[key] = (row.version, since)
                if not self._stale(row, now - since) or key in self._named:
                    continue
                if key in self._suspect:
                    self._named[key] = row
                    events.append(self._event("stale", row, table.version, now - since))
                else:
                    suspect.add(key)
            for key in [k for k in self._named if k not in seen]:
                row = self._named.pop(key)
                events.append(self._event("gone", row, table.version, now - self._since.get(key, (0, now))[1]))
            self._since = {k: v for k, v in self._since.items() if k in seen}
            self._suspect = suspect
        for event in events:
            self._act(event)
        return events

    def _stale(self, row: ReaderRow, behind_for: float) -> bool:
        late = self.stale_after is not None and behind_for >= self.stale_after
        far = self.max_lag is not None and row.behind is not None and row.behind >= self.max_lag
        if not (late or far):
            return False
        if not row.waiting:
            return True
        # Waiting for work runs no weights: only a stopped process is frozen.
        state = row.state or (process_state(row.pid) if row.host == HOST and row.report_age_s is None else "")
        return state in STOPPED

    def _event(self, kind: str, row: ReaderRow, version: int, behind_for: float) -> StaleEvent:
        who = f"{row.label} of store {row.store!r}"
        if kind == "recovered":
            message = f"{who} recovered: loaded version {row.version} (it was behind for {behind_for:.1f} s)"
        elif kind == "gone":
            message = f"{who}, stale since {behind_for:.1f} s ago, left the table (its process ended or its host went)"
        else:
            if row.behind is None:
                behind = f"has loaded no version (newest {version})"
            else:
                versions = f"{row.behind} version{'s' * (row.behind != 1)}"
                behind = f"is {versions} behind (loaded {row.version}, newest {version})"
            state = row.state or (process_state(row.pid) if row.host == HOST and row.report_age_s is None else "")
            message = f"{who} {behind} for {behind_for:.1f} s" + (f"; its process is {state}" if state else "")
        return StaleEvent(kind, row, version, behind_for, message)

    def _act(self, event: StaleEvent) -> None:
        if callable(self.on_stale):
            self.on_stale(event)
            return
        log.warning("shmsync: %s", event.message)
        if self.on_stale == "raise" and event.kind == "stale":
            self.pending = StaleReaderError(event.message, event)

    def raise_pending(self) -> None:
        """Raise the :class:`~shmsync.errors.StaleReaderError` found since the last call, if any
        (``on_stale="raise"``), once."""
        error, self.pending = self.pending, None
        if error is not None:
            raise error

    # -- running on the alarm thread ------------------------------------------------------------
    def start(self) -> ReaderAlarm:
        """Check twice a second on the alarm thread (one for the whole process) until
        :meth:`stop`, or until the table can no longer be read."""
        self.stopped = False
        _ticker().add(self)
        return self

    def stop(self) -> None:
        """Stop checking: the alarm thread checks this alarm no more once its current check, if
        any, ends. Takes no lock, so a finalizer may call it on any thread, the alarm thread
        included (a collector or scheme garbage-collected there stops its alarm)."""
        self.stopped = True


def check_settings(stale_after: Any, max_lag: Any, on_stale: Any) -> None:
    """Raise ValueError for alarm settings out of range."""
    if stale_after is not None and (isinstance(stale_after, bool) or not isinstance(stale_after, (int, float))):
        raise InvalidArgumentError(f"stale_after must be a number of seconds > 0 or None, got {stale_after!r}")
    if stale_after is not None and not stale_after > 0:
        raise InvalidArgumentError(f"stale_after must be > 0 seconds or None, got {stale_after!r}")
    if max_lag is not None and (isinstance(max_lag, bool) or not isinstance(max_lag, int) or max_lag < 1):
        raise InvalidArgumentError(f"max_lag must be an int >= 1 or None, got {max_lag!r}")
    if not callable(on_stale) and on_stale not in ("warn", "raise"):
        raise InvalidArgumentError(f"on_stale must be 'warn', 'raise' or a function, got {on_stale!r}")


class _Ticker:
    """The one thread of a process that runs every started alarm's check.

    Only :meth:`add` and the thread take :attr:`lock`; stopping an alarm sets its flag and the
    thread drops it at its next tick. Garbage collection may run a finalizer on the thread while
    it holds the lock (any allocation can collect), and a finalizer that stops an alarm must not
    wait for that lock: the thread would wait for itself.
    """

    def __init__(self) -> None:
        self.alarms: weakref.WeakSet[ReaderAlarm] = weakref.WeakSet()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def add(self, alarm: ReaderAlarm) -> None:
        with self.lock:
            self.alarms.add(alarm)
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="shmsync-alarm", daemon=True)
                self.thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(TICK)
            with self.lock:
                alarms = []
                for alarm in list(self.alarms):
                    if alarm.stopped:
                        self.alarms.discard(alarm)
                    else:
                        alarms.append(alarm)
                if not alarms:
                    self.thread = None
                    return
            for alarm in alarms:
                if alarm.stopped:  # stopped since the list was taken
                    continue
                try:
                    alarm.check()
                except Exception as e:  # a closed store, a report that broke: this alarm ends
                    log.debug("shmsync: a reader alarm stopped: %s", e)
                    alarm.stopped = True


_TICKER: _Ticker | None = None
_TICKER_LOCK = threading.Lock()


def _ticker() -> _Ticker:
    global _TICKER
    with _TICKER_LOCK:
        if _TICKER is None:
            _TICKER = _Ticker()
        return _TICKER


__all__ = ["ReaderAlarm", "StaleEvent"]
