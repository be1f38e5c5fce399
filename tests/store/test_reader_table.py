"""The readers' table: rows of readers in real processes, read from the store's header without a
word to any of them; rows and report files from elsewhere checked like any other input."""

import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch

from shmsync import WeightReader, WeightStore
from shmsync.core import segment
from shmsync.core.header import Mode
from shmsync.store.reader_table import HostReport, ReaderRow, ReaderTable, Transfer
from shmsync.testing import header_bytes
from shmsync.watch.remote_rows import (
    MAX_REPORT_ROWS,
    HostRows,
    read_report_file,
    report_from_wire,
    report_path,
    report_to_wire,
    row_from_wire,
    row_to_wire,
    write_report_file,
)
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(120)


def read_as_worker(store: WeightStore, worker: int, zero_copy: bool, waiting: bool, conn) -> None:
    """Load the store as worker ``worker``, say so, then load each version it is told to."""
    reader = WeightReader(store, torch.nn.Linear(8, 4), worker=worker, zero_copy=zero_copy)
    reader.poll()
    reader.set_waiting(waiting)
    conn.send(("loaded", reader.version))
    while True:
        wanted = conn.recv()
        reader.wait(wanted, timeout=30)
        conn.send(("loaded", reader.version))


@pytest.mark.slow
def test_each_reader_has_a_row_with_its_worker_version_lag_mode_and_state(store_factory, start):
    policy = torch.nn.Linear(8, 4)
    store = store_factory(policy, num_slots=4)
    children = [start(read_as_worker, store, w, w == 1, w == 2) for w in range(3)]
    for child in children:
        assert child.expect("loaded") == (0,)
    for _ in range(3):
        store.publish(policy)
    children[0].conn.send(3)  # worker 0 catches up; the others stay at version 0
    assert children[0].expect("loaded") == (3,)

    table = store.readers(processes=True)
    assert table.version == 3 and len(table) == 3
    by_worker = {r.worker: r for r in table}
    assert {w: (r.pid, r.version, r.behind) for w, r in by_worker.items()} == {
        0: (children[0].pid, 3, 0),
        1: (children[1].pid, 0, 3),
        2: (children[2].pid, 0, 3),
    }
    assert [by_worker[w].mode for w in range(3)] == ["copy", "in place", "copy"]
    assert [by_worker[w].waiting for w in range(3)] == [False, False, True]
    assert table[0].behind == 3 and table[-1].worker == 0, "the worst lagging readers come first"
    assert all(r.state in ("sleeping", "running") and r.uss and r.uss > 0 for r in table)
    assert by_worker[0].reloads == 2 and by_worker[0].since_reload_s < by_worker[1].since_reload_s

    os.kill(children[1].pid, signal.SIGSTOP)
    try:
        # The kernel stops the process once the signal is delivered, not at kill() itself.
        wait_for(
            lambda: {r.worker: r.state for r in store.readers(processes=True)}[1] == "stopped",
            timeout=10,
            what="the stopped reader's row to say so",
        )
    finally:
        os.kill(children[1].pid, signal.SIGCONT)

    children[2].proc.kill()
    children[2].proc.join(10)
    table = store.readers(processes=True)
    assert sorted(r.worker for r in table) == [0, 1]
    assert [(r.worker, r.state) for r in table.gone] == [(2, "gone")], "a dead reader's row is shown as gone"
    assert "2 readers on 1 host; 1 reader behind (worst: 3 versions, worker 1" in table.summary()
    assert "1 gone" in table.summary()


def test_reading_the_table_writes_nothing_and_takes_no_lock(store_factory):
    store = store_factory(torch.nn.Linear(8, 4))
    reader = WeightReader(store, torch.nn.Linear(8, 4), worker=7)
    reader.poll()
    before = header_bytes(store)
    for _ in range(10):
        assert [r.worker for r in store.readers(processes=True)] == [7]
    assert header_bytes(store) == before


def test_a_table_of_many_readers_stays_readable(store_factory):
    store = store_factory(torch.nn.Linear(2, 2))
    # Copying readers: the table is the point here, not where they run (each in place maps the store).
    readers = [WeightReader(store, torch.nn.Linear(2, 2), worker=i, zero_copy=False) for i in range(250)]
    for r in readers[:240]:
        r.poll()
    store.publish(torch.nn.Linear(2, 2))
    for r in readers[:230]:
        r.poll()
    table = store.readers()
    assert len(table) == 250
    text = table.format(limit=20)
    lines = text.splitlines()
    assert lines[0].startswith(f"{store.name}: version 1, 250 readers on 1 host; 10 readers behind (worst: 1 version")
    assert lines[0].endswith("; 10 readers not loaded yet")
    assert len(lines) == 1 + 1 + 20 + 1 and lines[-1].startswith("... and 230 more")
    shown = [line.split()[1] for line in lines[2:22]]
    assert set(shown[:10]) == {str(i) for i in range(240, 250)}, "readers that never loaded come first"
    assert set(shown[10:]) == {str(i) for i in range(230, 240)}
    doc = json.loads(json.dumps(table.as_dict()))
    assert len(doc["readers"]) == 250 and doc["version"] == 1


def _row(**changes):
    fields = dict(worker=3, pid=1234, version=7, since_reload_s=0.5, reloads=8, mode=1, waiting=False)
    fields.update(state="sleeping", uss=None)
    fields.update(changes)
    return [fields[k] for k in ("worker", "pid", "version", "since_reload_s", "reloads", "mode", "waiting")] + [
        fields["state"],
        fields["uss"],
    ]


def test_a_row_from_another_host_round_trips():
    row = row_from_wire(_row(), "host-b", "policy", 1.5)  # a row of an older relay: 9 fields
    assert (row.host, row.worker, row.pid, row.version, row.mode, row.report_age_s) == (
        "host-b", 3, 1234, 7, "in place", 1.5,
    )  # fmt: skip
    assert (row.device_bytes, row.copied_bytes) == (0, 0)
    assert row_from_wire(row_to_wire(row), "host-b", "policy", 1.5) == row
    copying = row_from_wire([*_row(), 4096, 1 << 20], "host-b", "policy", 1.5)
    assert (copying.device_bytes, copying.copied_bytes) == (4096, 1 << 20)
    assert row_from_wire(row_to_wire(copying), "host-b", "policy", 1.5) == copying
    with pytest.raises(ValueError, match="copied_bytes"):
        row_from_wire([*_row(), 0, -1], "host-b", "policy", 1.5)


def test_each_row_says_what_its_readers_last_reload_copied(store_factory):
    """A copying reader copies everything at its first load, then what changed (and the small
    tensors); one in place its buffers (none here): in the rows, the text table and the JSON."""

    def policy_of() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 2))  # 256 KiB, 2 KiB

    policy = policy_of()
    store = store_factory(policy)
    copying = WeightReader(store, policy_of(), worker=0, zero_copy=False)
    viewing = WeightReader(store, policy_of(), worker=1)
    copying.poll(), viewing.poll()
    everything = sum(t.numel() * t.element_size() for t in policy.state_dict().values())
    assert {r.worker: r.copied_bytes for r in store.readers(processes=False)} == {0: everything, 1: 0}
    with torch.no_grad():
        policy[1].weight.add_(1.0)
    store.publish(policy)
    copying.poll(), viewing.poll()
    table = store.readers(processes=False)
    small = (256 + 2 * 256 + 2) * 4  # all but the first layer's weights (small: copied, no proof)
    assert {r.worker: r.copied_bytes for r in table} == {0: small, 1: 0}
    text = table.format()
    assert "COPIED" in text.splitlines()[1] and "3.0 KiB" in text
    rows = json.loads(json.dumps(table.as_dict()))["readers"]
    assert {r["worker"]: r["copied_bytes"] for r in rows} == {0: small, 1: 0}


@pytest.mark.parametrize(
    "change, field",
    [
        ({"worker": -1}, "worker"),
        ({"pid": 0}, "pid"),
        ({"pid": True}, "pid"),
        ({"version": -2}, "version"),
        ({"version": 1 << 63}, "version"),
        ({"since_reload_s": -1.0}, "since_reload_s"),
        ({"since_reload_s": float("nan")}, "since_reload_s"),
        ({"reloads": "8"}, "reloads"),
        ({"mode": 9}, "mode"),
        ({"waiting": 1}, "waiting"),
        ({"state": "\x1b[2J"}, "state"),
        ({"state": "x" * 100}, "state"),
        ({"uss": -5}, "uss"),
    ],
)
def test_a_row_from_another_host_is_checked_field_by_field(change, field):
    with pytest.raises(ValueError, match=field):
        row_from_wire(_row(**change), "host-b", "policy", 0.0)


@pytest.mark.parametrize(
    "doc",
    [
        None,
        [],
        {"hosts": [], "extra": 1},
        {"hosts": [["h", "0123456789abcdef", "policy", 0.0]]},
        {"hosts": [["h", "not-a-node-id!!!", "policy", 0.0, []]]},
        {"hosts": [["h\n", "0123456789abcdef", "policy", 0.0, []]]},
        {"hosts": [["h", "0123456789abcdef", "policy", 0.0, [_row()] * (MAX_REPORT_ROWS + 1)]]},
        {"hosts": [["h", "0123456789abcdef", "policy", 0.0, [[1, 2]]]]},
    ],
)
def test_a_report_that_breaks_its_schema_is_refused(doc):
    with pytest.raises(ValueError):
        report_from_wire(doc)


def test_the_report_file_round_trips_and_ages(store_dir):
    rows = [ReaderRow("policy", "host-b", 0, 99, 4, None, 0.25, 5, "copy", state="running", report_age_s=0.5)]
    hosts = [HostReport("host-b", "relay 1", "policy", 0.5, "reporting", 1)]
    write_report_file("policy", hosts, rows)
    assert oct(os.stat(report_path("policy")).st_mode & 0o777) == "0o600"
    assert segment.list_entries() == [], "a report file is never taken for a store"
    got_hosts, got_rows = read_report_file("policy", store_version=6)
    assert [(h.host, h.via, h.state, h.readers) for h in got_hosts] == [("host-b", "relay 1", "reporting", 1)]
    (row,) = got_rows
    assert (row.host, row.pid, row.version, row.behind) == ("host-b", 99, 4, 2)
    assert row.report_age_s >= 0.5 and row.since_reload_s >= 0.25


def test_what_each_hosts_versions_cost_round_trips_and_shows_in_the_table(store_dir):
    """A relay reports what the versions that reached its host cost on its link; the trainer's
    table and the report file `shmsync ls NAME` reads carry it, and the text table shows it."""
    transfer = Transfer(version=12, last_bytes=66_000, last_delta=True, deltas=11, wholes=1, total_bytes=4_900_000)
    entry = HostRows("host-b", "0123456789abcdef", "policy", 0.0, (), transfer)
    (back,) = report_from_wire(json.loads(json.dumps(report_to_wire([entry]))))
    assert back.transfer == transfer
    hosts = [HostReport("host-b", "relay 1", "policy", 0.5, "reporting", 0, transfer)]
    write_report_file("policy", hosts, [])
    got_hosts, _ = read_report_file("policy", store_version=12)
    assert [h.transfer for h in got_hosts] == [transfer]
    text = ReaderTable("policy", 12, [], hosts=got_hosts).format()
    lines = text.splitlines()
    assert lines[-2].startswith("HOST") and "LAST VERSION" in lines[-2] and "SENT AS" in lines[-2], text
    assert lines[-1].split()[:5] == ["host-b", "relay", "1", "12", "delta"], text
    unreported = HostReport("host-c", "relay 2", "policy", 0.5, "reporting", 0)  # a node that reports none
    assert "SENT AS" not in ReaderTable("policy", 12, [], hosts=[unreported]).format()


@pytest.mark.parametrize("how", ["garbage", "schema", "link", "huge"])
def test_a_report_file_that_is_not_ours_or_not_right_is_ignored(store_dir, caplog, how):
    path = report_path("policy")
    if how == "garbage":
        Path(path).write_bytes(os.urandom(300))
    elif how == "schema":
        Path(path).write_text(json.dumps({"format": 1, "written_ns": 1, "hosts": [["h"]], "rows": []}))
    elif how == "link":
        target = store_dir / "elsewhere"
        target.write_text(json.dumps({"format": 1, "written_ns": 1, "hosts": [], "rows": []}))
        os.symlink(target, path)
    else:
        with open(path, "wb") as f:
            f.truncate(17 << 20)
    os.chmod(path, 0o600, follow_symlinks=False) if how != "link" else None
    with caplog.at_level(logging.WARNING, logger="shmsync.store.reader_table"):
        assert read_report_file("policy", store_version=1) == ([], [])
    if how != "link":  # a link is not even opened
        assert "ignored" in caplog.text


def test_a_reader_table_names_its_readers_on_an_empty_store(store_factory):
    store = store_factory(torch.nn.Linear(2, 2))
    table = store.readers()
    assert isinstance(table, ReaderTable) and len(table) == 0 and not table
    assert table.summary() == f"{store.name}: version 0, 0 readers"
    reader = WeightReader(store, torch.nn.Linear(2, 2))
    wait_for(lambda: len(store.readers()) == 1, what="the reader's row")
    assert store.readers()[0].version == -1 and store.readers()[0].behind is None
    reader.close()
    assert len(store.readers()) == 0 and not store.readers().gone, "a reader that left leaves no row"


def test_a_readers_mode_is_the_one_its_row_shows(store_factory):
    """The reader keeps one mode and writes it into its row: the table reads the same value back,
    spelled once (``Mode``); ``viewing`` means the same on both sides, ``zero_copy`` the wish."""
    policy = torch.nn.Linear(8, 4)
    store = store_factory(policy, num_slots=3)
    in_place = WeightReader(store, torch.nn.Linear(8, 4))
    copying = WeightReader(store, torch.nn.Linear(8, 4), zero_copy=False)
    assert in_place.mode is Mode.FALLEN_BACK and in_place.zero_copy and not in_place.viewing  # not loaded yet
    assert in_place.poll() and copying.poll()
    assert (in_place.mode, copying.mode) == (Mode.IN_PLACE, Mode.COPY)
    assert (in_place.zero_copy, copying.zero_copy) == (True, False)
    rows = list(store.readers())
    assert sorted(r.mode for r in rows) == sorted([in_place.mode, copying.mode])
    assert sorted(r.viewing for r in rows) == [False, True]
    with pytest.warns(DeprecationWarning, match="ReaderRow.viewing"):
        assert sorted(r.zero_copy for r in rows) == [False, True]
    with pytest.warns(DeprecationWarning, match=r"Mode.PRIVATE is deprecated \(removed in 0.4.0\): use Mode.COPY"):
        assert Mode.PRIVATE is Mode.COPY  # 0.2.0's name
    copying.close()
    in_place.close()
    assert in_place.mode is Mode.COPY and not in_place.zero_copy
