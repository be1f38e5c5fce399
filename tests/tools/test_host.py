"""Liveness from the kernel's locks, not from pids: a store whose trainer lives in another PID
namespace (a container sharing /dev/shm) is never collected, a dead one is whatever pid its
header names, and pids read from a header are never signalled."""

import json
import os
import signal
import time

import pytest
import torch

from shmsync import WeightReader, WeightStore
from shmsync.core import segment
from shmsync.core.header import (
    B_LEASES,
    B_SEQ,
    B_TOKEN_PID,
    HOST,
    MAX_READERS,
    R_LEASE,
    R_PID,
    ROW_WORDS,
    W_CREATOR_PID,
    W_CREATOR_START,
    W_WRITER_PID,
    bank_word,
)
from shmsync.testing import read_header_word, read_with, write_header_word
from shmsync.tools import host
from tests.commands import cli
from tests.processes import canary, create_and_hang, create_in_dir_and_hang, hold_store
from tests.weights import blob_weights

pytestmark = pytest.mark.timeout(120)


def _dead_pid(ctx) -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = ctx.Process(target=time.sleep, args=(0,))
    proc.start()
    proc.join(30)
    return proc.pid


def _gc(store_dir, *args):
    env = {**os.environ, "SHMSYNC_DIR": str(store_dir)}
    import json

    return [r["name"] for r in json.loads(cli("gc", *args, "--json", env=env).stdout)["removed"]]


@pytest.mark.slow
def test_a_trainer_in_another_pid_namespace_keeps_its_store(store_dir, start, ctx):
    store = WeightStore.create(torch.nn.Linear(64, 64), name="policy")
    try:
        reader = start(hold_store, store_dir, "policy", False)
        reader.expect("holding")
        # What a header written in another PID namespace looks like from here: pids of nobody.
        for word, value in ((W_CREATOR_PID, _dead_pid(ctx)), (W_CREATOR_START, 0), (W_WRITER_PID, _dead_pid(ctx))):
            write_header_word(store, word, value)
        assert WeightStore.attach("policy").writer_alive()
        status = host.status("policy")
        assert status.held and status.creator_alive and status.writer_held and not host.is_orphaned(status)
        assert _gc(store_dir, "--orphaned") == [] and _gc(store_dir) == []
        assert "in use" in cli("ls", env={**os.environ, "SHMSYNC_DIR": str(store_dir)}).stdout
        store.release_writer()  # the creator alone, holding the store open, still counts
        assert WeightStore.attach("policy").writer_alive() and _gc(store_dir, "--orphaned") == []
        assert WeightStore.attach("policy").version == 0  # new workers still attach
    finally:
        store.close()


@pytest.mark.slow
def test_a_dead_store_is_collected_whatever_pid_its_header_names(store_dir, start):
    child = start(create_in_dir_and_hang, store_dir, "dead")
    child.expect("created")
    os.kill(child.pid, signal.SIGKILL)
    child.proc.join(10)
    store = WeightStore.attach("dead")
    write_header_word(store, W_CREATOR_PID, 1)  # init: alive forever, by pid
    store.close()
    assert _gc(store_dir, "--dry-run") == ["dead"]
    assert _gc(store_dir) == ["dead"] and not os.listdir(store_dir)


@pytest.mark.slow
def test_a_reader_in_another_pid_namespace_keeps_its_lease(store_dir, start, ctx):
    store = WeightStore.create(torch.nn.Linear(64, 64), name="policy", num_slots=4)
    try:
        viewer = start(hold_store, store_dir, "policy", True)
        viewing, version = viewer.expect("holding")
        assert viewing and version == 0
        (row,) = [r for r in range(MAX_READERS) if read_header_word(store, ROW_WORDS[r][R_PID])]
        leased = read_header_word(store, ROW_WORDS[row][R_LEASE]) - 1
        write_header_word(store, ROW_WORDS[row][R_PID], _dead_pid(ctx))  # its pid, as this namespace sees it: nobody
        before = read_header_word(store, bank_word(HOST, B_SEQ + leased))
        # Two more readers in place on two newer slots: the third distinct leased slot is one
        # too many, so the table is recounted, which must keep the live reader's lease.
        store.publish(torch.nn.Linear(64, 64))
        second = WeightReader(WeightStore.attach("policy"), torch.nn.Linear(64, 64), zero_copy=True)
        assert second.poll() and second.viewing
        store.publish(torch.nn.Linear(64, 64))
        third = WeightReader(WeightStore.attach("policy"), torch.nn.Linear(64, 64), zero_copy=True)
        assert third.poll() and not third.viewing, "the recount dropped a live reader's lease"
        for _ in range(20):
            store.publish(torch.nn.Linear(64, 64))
        assert read_header_word(store, bank_word(HOST, B_SEQ + leased)) == before, (
            "the writer rewrote the slot a live reader views"
        )
        assert read_header_word(store, bank_word(HOST, B_LEASES + leased)) >= 1
        assert sorted(r.viewing for r in store.readers()) == [False, True, True]
    finally:
        store.close()


@pytest.mark.slow
def test_pids_in_a_header_are_never_signalled(store_dir, start):
    bird = start(canary)
    (pid,) = bird.expect("ready")
    store = WeightStore.create(torch.nn.Linear(64, 64), name="policy")
    try:
        reader = WeightReader(WeightStore.attach("policy"), torch.nn.Linear(64, 64))
        reader.poll()
        for word in (
            W_CREATOR_PID,
            W_WRITER_PID,
            bank_word(HOST, B_TOKEN_PID),
            ROW_WORDS[1][R_PID],
        ):  # row 1: nobody holds it
            write_header_word(store, word, pid)
        env = {**os.environ, "SHMSYNC_DIR": str(store_dir)}
        cli("ls", env=env)
        cli("ls", "--json", env=env)
        _gc(store_dir)
        _gc(store_dir, "--orphaned")
        store.readers()
        store.publish(torch.nn.Linear(64, 64))
        read_with(reader.store, lambda slot, views: None, pinned=True, timeout=5, steal_after=0.0)
        assert reader.poll() and store.writer_alive()
    finally:
        store.close()
    bird.conn.send("report")
    (received,) = bird.expect("received")
    assert received == [] and bird.proc.is_alive()


@pytest.mark.slow
def test_creator_killed_then_gc(start):
    child = start(create_and_hang, {"a": 1000})
    (name,) = child.expect("created")
    assert name in segment.list_names()
    os.kill(child.pid, signal.SIGKILL)
    child.proc.join(10)
    ls = json.loads(cli("ls", "--json").stdout)
    row = next(r for r in ls if r["name"] == name)
    assert row["creator_alive"] is False and row["held"] is False
    # Only this test's store: under xdist other tests' dead-creator stores are theirs to check.
    dry = json.loads(cli("gc", name, "--dry-run", "--json").stdout)
    assert [r["name"] for r in dry["removed"]] == [name]
    assert name in segment.list_names(), "--dry-run removed something"
    json.loads(cli("gc", name, "--json").stdout)
    assert name not in segment.list_names()


@pytest.mark.slow
def test_gc_keeps_stores_in_use(store_factory, start):
    # A store whose creator died but that a live process still holds is kept.
    child = start(create_and_hang, {"a": 10})
    (name,) = child.expect("created")
    held = WeightStore.attach(name)
    os.kill(child.pid, signal.SIGKILL)
    child.proc.join(10)
    assert json.loads(cli("gc", name, "--json").stdout)["removed"] == []
    held.close()
    assert [r["name"] for r in json.loads(cli("gc", name, "--json").stdout)["removed"]] == [name]
    # and a store whose creator lives is never garbage
    mine = store_factory(blob_weights({"a": 10}))
    assert json.loads(cli("gc", mine.name, "--dry-run", "--json").stdout)["removed"] == []
