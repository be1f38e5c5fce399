"""The readers' table: every reader of a store, on this host and on others, as an operator sees it.

Each reader keeps a row in its store's header (see :mod:`shmsync.core.header`): its pid, the version
it loaded, its reload count and the time of its last reload, its lease, the worker index its
collector gave it, and a few flags. Reading the table reads those words and asks the kernel which
rows' readers live: it sends no message and never waits for a reader, so it works mid-rollout,
on a frozen worker too. Readers on other hosts come in reports their relays send upstream
(:mod:`shmsync.relay`) or that the nodes of a distributed collector answer each push with
(:mod:`shmsync.torchrl.distributed`); their rows carry the age of that report.

A row's words are written by its reader without a lock, so a row read while its reader reloads
may mix two reloads' counts; the flags are read before the version, so a reader that starts a
rollout (it loads, then clears its waiting flag) is never seen active with the old version.

Examples:
    >>> import torch
    >>> from shmsync import WeightReader, WeightStore
    >>> policy = torch.nn.Linear(4, 2)
    >>> with WeightStore.create(policy) as store:
    ...     reader = WeightReader(store, torch.nn.Linear(4, 2), worker=0)
    ...     _ = reader.poll()
    ...     _ = store.publish(policy)
    ...     table = store.readers()
    ...     (row,) = table
    ...     row.worker, row.version, row.behind, table.version
    (0, 0, 1, 1)
"""

from __future__ import annotations

import logging
import math
import socket
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Protocol

from shmsync.core.header import (
    R_COPIED_BYTES,
    R_DEVICE_BYTES,
    R_DEVICE_LEASE,
    R_FLAGS,
    R_LEASE,
    R_PID,
    R_RELOAD_NS,
    R_RELOADS,
    R_START_NS,
    R_VERSION,
    R_WORKER,
    ROW_LINK,
    ROW_WAITING,
    W_STEPS,
    W_VERSION,
    Mode,
    reader_rows,
)
from shmsync.core.pages import human_bytes
from shmsync.core.processes import process_state, process_uss
from shmsync.core.protocol import steps_of
from shmsync.errors import warn_deprecated

log = logging.getLogger("shmsync.table")

MODES = tuple(mode.value for mode in Mode)  # a row's mode on the relays' wire is its index here
HOST = socket.gethostname()
# States of a reader's process (psutil's names), and ours: "gone" (no such process any more),
# "unknown" (a pid this host's process table cannot vouch for: reused, or of another namespace),
# "" (not looked up), and for remote rows "lost" (the link to their host ended).
STOPPED = ("stopped", "tracing-stop")
MAX_WORKER = 1 << 31


@dataclass(slots=True)
class ReaderRow:
    """One reader of a store, as the readers' table shows it.

    Attributes:
        store: the store's name (on its host).
        host: the host the reader runs on.
        worker: the worker index its collector gave it (None outside a collector).
        pid: its process id, as its host numbers it.
        version: the version it loaded (-1 before its first load).
        behind: versions behind the newest publish (None before its first load).
        since_reload_s: seconds since its last reload (None before its first load).
        reloads: how many times it loaded a version.
        mode: how its module holds its weights, the value of a :class:`~shmsync.core.header.Mode`:
            ``"in place"`` (its module views the store), ``"copy"`` (a private copy),
            ``"copy (fallback)"`` (in place where it can, and copies now: not loaded yet, or every
            slot it could lease was taken), ``"device"`` (a private copy in an accelerator's
            memory) or ``"device in place"`` (its GPU module views a device slot of the store).
        waiting: between rollouts, waiting for work (a collector's worker): not running weights.
        state: its process's state (``running``, ``sleeping``, ``stopped``, ``zombie``, ``gone``...,
            ``unknown`` for a pid this host cannot vouch for, ``lost`` for a remote reader whose
            host stopped reporting), or ``""`` where it was not looked up.
        uss: its process's private memory in bytes (unique set size), where looked up.
        report_age_s: for a reader on another host, the age of the report its row came in;
            None for a row read from this host's store just now.
        device_bytes: GPU memory the reader holds of its own (a private device copy; 0 in place).
        steps_behind: optimizer steps the trainer took on the weights since the version the
            reader loaded was published (None where not known: before its first load, a version
            more than 64 publishes old, a store a relay fills).
        copied_bytes: bytes its last reload copied into its module: a copying reader copies what
            changed since the version it held (all of it at its first load), one in place its
            buffers (see :mod:`shmsync.reader.held_copy`).
    """

    store: str
    host: str
    worker: int | None
    pid: int
    version: int
    behind: int | None
    since_reload_s: float | None
    reloads: int
    mode: str
    waiting: bool = False
    state: str = ""
    uss: int | None = None
    report_age_s: float | None = None
    device_bytes: int = 0
    steps_behind: int | None = None
    copied_bytes: int = 0

    @property
    def viewing(self) -> bool:
        """Whether its module's parameters view a leased slot of the store (host or device), as
        :attr:`WeightReader.viewing <shmsync.WeightReader.viewing>` says in its process."""
        return Mode(self.mode).viewing

    @property
    def zero_copy(self) -> bool:
        """Deprecated: whether its module views a host slot in place (``mode == "in place"``); use
        :attr:`viewing` (``zero_copy`` names a reader's wish to run in place where it can)."""
        warn_deprecated("ReaderRow.zero_copy", "ReaderRow.viewing (or mode == 'in place')", "0.4.0")
        return self.mode == Mode.IN_PLACE

    @property
    def stopped(self) -> bool:
        """Whether its process is stopped (SIGSTOP, a debugger)."""
        return self.state in STOPPED

    @property
    def label(self) -> str:
        """How log lines name it: ``worker 2 (pid 1234 on host-a)``."""
        who = f"worker {self.worker}" if self.worker is not None else "reader"
        return f"{who} (pid {self.pid} on {self.host})"

    def as_dict(self) -> dict[str, Any]:
        """The row as plain JSON types (the ``--json`` schema of ``shmsync ls NAME``)."""
        return asdict(self)


@dataclass(frozen=True)
class Transfer:
    """What the versions that reached one host cost on the network.

    Attributes:
        version: the last version it received.
        last_bytes: the bytes that version took on its link (frames and tags included).
        last_delta: whether it came as a delta (the leaves changed since the version before),
            not whole.
        deltas, wholes: how many versions it received each way.
        total_bytes: the bytes all of them took.
    """

    version: int
    last_bytes: int
    last_delta: bool
    deltas: int
    wholes: int
    total_bytes: int

    def to_wire(self) -> list[Any]:
        return [self.version, self.last_bytes, self.last_delta, self.deltas, self.wholes, self.total_bytes]


@dataclass(frozen=True)
class HostReport:
    """What the trainer last heard from one other host.

    Attributes:
        host: its name.
        via: what carried it (``"relay 3"``, ``"node 1"``, ``"actor 0"``).
        store: the store's name there.
        age_s: seconds since its rows were read there.
        state: ``"reporting"``, ``"silent"`` (no report for a while) or ``"lost"`` (its link ended).
        readers: how many readers it reported.
        transfer: what the versions it received cost on the network (None: not reported).
    """

    host: str
    via: str
    store: str
    age_s: float
    state: str
    readers: int
    transfer: Transfer | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class ReaderTable:
    """Every reader of a store, worst lagging first. Iterating, indexing and ``len`` go over the
    live readers; :attr:`gone` holds rows of readers whose process died without leaving.

    Attributes:
        store: the store's name.
        version: the store's newest complete version (the trainer's, for remote rows): each
            row's ``behind`` counts from it.
        rows: the live readers, worst lagging first.
        gone: rows left by readers that died.
        hosts: what each other host last reported.
        taken_ns: wall-clock time of the read.
    """

    store: str
    version: int
    rows: list[ReaderRow]
    gone: list[ReaderRow] = field(default_factory=list)
    hosts: list[HostReport] = field(default_factory=list)
    taken_ns: int = 0

    def __iter__(self) -> Iterator[ReaderRow]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> ReaderRow:
        return self.rows[i]

    def __bool__(self) -> bool:
        return bool(self.rows)

    @property
    def latest(self) -> int:
        """Deprecated: :attr:`version` (renamed in 0.3.0, removed in 0.4.0)."""
        warn_deprecated("ReaderTable.latest", "ReaderTable.version", "0.4.0")
        return self.version

    @property
    def max_behind(self) -> int:
        """The most versions any live reader is behind (0 with none)."""
        return max((r.behind for r in self.rows if r.behind is not None), default=0)

    def summary(self) -> str:
        """One line: how many readers on how many hosts, how many are behind, the worst one."""
        hosts = {r.host for r in self.rows}
        head = f"{self.store}: version {self.version}, {_count(len(self.rows), 'reader')}"
        head += f" on {_count(len(hosts), 'host')}" if self.rows else ""
        return "; ".join([head, *self._troubles()])

    def _troubles(self) -> list[str]:
        """What the summary line says beyond the counts: who is behind, stopped, gone, silent."""
        stopped = sum(r.stopped for r in self.rows)
        silent = [h.host for h in self.hosts if h.state != "reporting"]
        parts = self._lag()
        if stopped:
            parts.append(f"{stopped} stopped")
        if self.gone:
            parts.append(f"{len(self.gone)} gone")
        if silent:
            parts.append(f"no report from {', '.join(silent)}")
        return parts

    def _lag(self) -> list[str]:
        """How far the readers trail: the worst one behind, those not loaded yet, or all current."""
        behind = [r for r in self.rows if r.behind]  # a loaded reader's: an int
        unloaded = sum(r.behind is None for r in self.rows)
        parts = []
        if behind:
            worst = f"worst: {_count(behind[0].behind or 0, 'version')}, {behind[0].label}"
            parts.append(f"{_count(len(behind), 'reader')} behind ({worst})")
        if unloaded:
            parts.append(f"{_count(unloaded, 'reader')} not loaded yet")
        if self.rows and not behind and not unloaded:
            parts.append("all at the newest version")
        return parts

    def as_dict(self) -> dict[str, Any]:
        """The table as plain JSON types (``shmsync ls NAME --json``)."""
        return {
            "store": self.store,
            "version": self.version,
            "taken_ns": self.taken_ns,
            "readers": [r.as_dict() for r in self.rows],
            "gone": [r.as_dict() for r in self.gone],
            "hosts": [h.as_dict() for h in self.hosts],
        }

    def format(self, limit: int | None = 50) -> str:
        """The summary line, then one line per reader, worst first, at most ``limit`` of them."""
        return format_rows(self, limit)

    def __str__(self) -> str:
        return self.format()


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}{'s' * (n != 1)}"


def _order(row: ReaderRow) -> tuple:
    # Worst first: most versions behind, then the longest without a reload.
    return (-(row.behind if row.behind is not None else math.inf), -(row.since_reload_s or 0.0), row.host, row.pid)


def sort_rows(rows: Iterable[ReaderRow]) -> list[ReaderRow]:
    """``rows``, worst lagging first."""
    return sorted(rows, key=_order)


def local_rows(
    store: str,
    h: Any,
    alive: Callable[[list[int]], set[int]],
    store_version: int,
    *,
    processes: bool = False,
    memory: bool | None = None,
    now_ns: int | None = None,
) -> tuple[list[ReaderRow], list[ReaderRow]]:
    """The live and the gone readers in header words ``h`` (a memoryview, or words read with
    ``pread``), ``alive(rows)`` telling which rows' readers still hold their lock, each row behind
    ``store_version`` (the store's newest complete version) by what it says. With
    ``processes``, each row's process state is looked up (one read of ``/proc/PID/stat``), and
    with ``memory`` (default: as ``processes``) its private memory; the docs' Performance page
    has what each costs."""
    now = time.time_ns() if now_ns is None else now_ns
    memory = processes if memory is None else memory
    rows = [(row, w) for row, w in reader_rows(h) if not w[R_FLAGS] & ROW_LINK]  # a relay's link: no reader
    living = alive([row for row, _ in rows])
    steps = _StepsBehind(h)
    live: list[ReaderRow] = []
    gone: list[ReaderRow] = []
    for row, w in rows:
        is_alive = row in living
        state, uss = _process_facts(w, is_alive, processes, memory) if processes or not is_alive else ("", None)
        (live if is_alive else gone).append(_row(store, w, store_version, now, state, uss, steps(w[R_VERSION])))
    return live, gone


class _StepsBehind:
    """How many optimizer steps behind the trainer each version is, from header words ``h``: the
    writer's step count now, less the version's count in the steps ring (None where it has none)."""

    def __init__(self, h: Any) -> None:
        self.h, self.now, self.version = h, h[W_STEPS], h[W_VERSION]
        self.known: dict[int, int | None] = {}

    def __call__(self, version: int) -> int | None:
        if version not in self.known:
            then = steps_of(self.h, version, self.version)
            self.known[version] = max(0, self.now - then) if then is not None and self.now >= 0 else None
        return self.known[version]


def rebase(rows: Sequence[ReaderRow], store_version: int, age_s: float, **changes: Any) -> list[ReaderRow]:
    """Rows of a report ``age_s`` old, as seen now against ``store_version``: behind recomputed, their
    reload ages and report age moved on by ``age_s``."""
    out = []
    for r in rows:
        out.append(
            replace(
                r,
                behind=max(0, store_version - r.version) if r.version >= 0 else None,
                since_reload_s=None if r.since_reload_s is None else r.since_reload_s + age_s,
                report_age_s=(r.report_age_s or 0.0) + age_s,
                **changes,
            )
        )
    return out


def _process_facts(w: list[int], is_alive: bool, processes: bool, memory: bool) -> tuple[str, int | None]:
    """(state, private memory) of a row's process: ``gone`` when its lock is free (its pid may
    be another process's now), and the memory of a live one only with ``memory``."""
    state = process_state(w[R_PID], w[R_START_NS]) if processes else "gone"
    if not is_alive:
        return (state if state in ("zombie", "gone") else "gone"), None
    uss = process_uss(w[R_PID]) if memory and state not in ("unknown", "gone") else None
    return state, uss


def _row(
    store: str, w: list[int], store_version: int, now: int, state: str, uss: int | None, steps_behind: int | None
) -> ReaderRow:
    """A row of this host's table from its header words ``w``."""
    version, stamp, flags = w[R_VERSION], w[R_RELOAD_NS], w[R_FLAGS]
    loaded = version >= 0
    return ReaderRow(
        store,
        HOST,
        w[R_WORKER] - 1 if 0 < w[R_WORKER] <= MAX_WORKER else None,
        w[R_PID],
        version,
        (store_version - version if store_version > version else 0) if loaded else None,
        ((now - stamp) / 1e9 if now > stamp else 0.0) if stamp > 0 and loaded else None,
        w[R_RELOADS] if w[R_RELOADS] > 0 else 0,
        Mode.of_row(flags, w[R_LEASE], w[R_DEVICE_LEASE]).value,
        bool(flags & ROW_WAITING),
        state,
        uss,
        device_bytes=max(w[R_DEVICE_BYTES], 0),
        steps_behind=steps_behind,
        copied_bytes=max(w[R_COPIED_BYTES], 0),
    )


# -- readers on other hosts -------------------------------------------------------------------------
class RemoteRows(Protocol):
    """What reports readers on other hosts into a store's table in this process (a relay sender,
    a distributed collector)."""

    @property
    def version(self) -> int:
        """The newest complete version it knows the trainer published (-1: none)."""

    def remote_rows(self, store_version: int) -> tuple[list[HostReport], list[ReaderRow]]:
        """The other hosts' reports and their rows, seen now against ``store_version``."""


class RemoteSources:
    """The sources of other hosts' rows that a store's (or a scheme's) table lists: held by that
    owner, each source weakly, so a source leaves the table when it goes (a relay sender closed).

    Examples:
        >>> sources = RemoteSources()
        >>> len(sources)
        0
    """

    def __init__(self) -> None:
        self._sources: weakref.WeakSet = weakref.WeakSet()

    def add(self, source: RemoteRows) -> None:
        """List ``source``'s rows in the owner's table."""
        self._sources.add(source)

    def discard(self, source: RemoteRows) -> None:
        self._sources.discard(source)

    def __len__(self) -> int:
        return len(self._sources)

    def __iter__(self) -> Iterator[RemoteRows]:
        return iter(list(self._sources))

    def __reduce__(self) -> tuple[type, tuple]:
        return (RemoteSources, ())  # a copy in another process lists no source of this one


def assemble(
    store: str,
    version: int,
    live: list[ReaderRow],
    gone: list[ReaderRow],
    sources: Iterable[RemoteRows] = (),
    *,
    hosts: Sequence[HostReport] = (),
    remote: Sequence[ReaderRow] = (),
) -> ReaderTable:
    """A table of local rows at the store's newest complete ``version``, with the rows of
    ``sources`` (other hosts) and those given."""
    hosts, remote, sources = list(hosts), list(remote), list(sources)
    version = max([version, *(source.version for source in sources)])
    for source in sources:
        more_hosts, more_rows = source.remote_rows(version)
        hosts += more_hosts
        remote += more_rows
    rows = sort_rows([*live, *(r for r in remote if r.state not in ("lost", "gone"))])
    gone = [*gone, *(r for r in remote if r.state in ("lost", "gone"))]
    return ReaderTable(store, version, rows, gone, hosts, time.time_ns())


def merge(tables: Sequence[ReaderTable]) -> ReaderTable:
    """One table of several (a collector's stores, one per worker): the newest version of them
    all, rows worst first, each row behind its own store's newest version."""
    if len(tables) == 1:
        return tables[0]
    return ReaderTable(
        _names(tables),
        max((t.version for t in tables), default=-1),
        sort_rows(r for t in tables for r in t.rows),
        [r for t in tables for r in t.gone],
        [h for t in tables for h in t.hosts],
        max((t.taken_ns for t in tables), default=time.time_ns()),
    )


def _names(tables: Sequence[ReaderTable]) -> str:
    """The stores of several tables that have anything to show, as one name."""
    named = [t.store for t in tables if t.rows or t.gone or t.hosts]
    return ", ".join(dict.fromkeys(named)) or (tables[0].store if tables else "")


def format_rows(table: ReaderTable, limit: int | None = 50) -> str:
    """``table`` as text: a summary line, then a row per reader (worst first), gone ones last."""
    head = ["HOST", "WORKER", "PID", "VERSION", "BEHIND", "STEPS BEHIND", "LAST RELOAD", "RELOADS", "COPIED", "MODE"]
    head += ["STATE", "USS", "GPU"]
    rows = [*table.rows, *table.gone]
    shown = rows if limit is None else rows[:limit]
    lines = [head, *(_cells(r) for r in shown)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = [table.summary()]
    text += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    if len(shown) < len(rows):
        text.append(f"... and {len(rows) - len(shown)} more (no further behind than the last shown)")
    text += _transfer_lines(table.hosts)
    return "\n".join(text)


def _transfer_lines(hosts: Sequence[HostReport]) -> list[str]:
    """Per other host that reported it, what its versions cost on the network (none: no lines)."""
    reported = [h for h in hosts if h.transfer is not None]
    if not reported:
        return []
    head = ["HOST", "VIA", "LAST VERSION", "SENT AS", "ITS BYTES", "DELTAS", "WHOLE", "ALL BYTES"]
    lines = [head]
    for h in reported:
        t = h.transfer
        assert t is not None
        kind = "delta" if t.last_delta else "whole"
        cells = [str(t.version), kind, human_bytes(t.last_bytes), str(t.deltas), str(t.wholes)]
        lines.append([h.host, h.via, *cells, human_bytes(t.total_bytes)])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return ["", *("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)]


def _cells(r: ReaderRow) -> list[str]:
    """A row of the text table."""
    state = r.state or "-"
    if r.waiting and r.state not in ("gone", "lost"):
        state += " (waiting)"
    if r.report_age_s is not None:
        state += f", report {_age(r.report_age_s)} old"
    return [
        r.host,
        "-" if r.worker is None else str(r.worker),
        str(r.pid),
        str(r.version),
        "-" if r.behind is None else str(r.behind),
        "-" if r.steps_behind is None else str(r.steps_behind),
        "never" if r.since_reload_s is None else f"{_age(r.since_reload_s)} ago",
        str(r.reloads),
        human_bytes(r.copied_bytes) if r.reloads else "-",
        r.mode,
        state,
        "-" if r.uss is None else human_bytes(r.uss),
        human_bytes(r.device_bytes) if r.device_bytes else "-",
    ]


def _age(s: float) -> str:
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.0f}h"


__all__ = ["HostReport", "ReaderRow", "ReaderTable", "Transfer"]
