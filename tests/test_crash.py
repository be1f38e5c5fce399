"""Crash safety with real processes and SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from shmsync import WeightReader, WeightStore, WriterGoneError, _segment
from shmsync._header import W_SEQ

from procs import STRESS_SIZES, Blob, blob_weights, create_and_hang, parent_of_a_watching_child, stress_reader, writer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _odd_slots(store):
    h = store.memory.header
    return [i for i in range(store.num_slots) if int(h[W_SEQ + i]) & 1]


def test_writer_killed_mid_publish(store_factory, start):
    store = store_factory(blob_weights(STRESS_SIZES, 0.0))
    store.release_writer()
    reader = start(stress_reader, store, STRESS_SIZES, 300)
    reader.expect("ready")
    killed_mid_copy = 0
    for attempt in range(6):
        w = start(writer, store.name, STRESS_SIZES, 10**9)
        w.expect("ready")
        time.sleep(0.2 + 0.13 * attempt)
        before = store.version
        os.kill(w.pid, signal.SIGKILL)
        w.proc.join(10)
        killed_mid_copy += bool(_odd_slots(store))
        # Readers stay on the last complete version, whose contents are whole.
        snap = store.snapshot()
        assert snap.version == store.version >= before
        assert all((t == float(snap.version)).all() for t in snap.weights.values())
        if killed_mid_copy >= 2:
            break
    assert killed_mid_copy >= 1, "never caught the writer in the middle of a copy"
    # A new writer continues the versions monotonically and readers follow.
    last = store.version
    w = start(writer, store.name, STRESS_SIZES, 3)
    w.expect("ready")
    assert w.expect("done")[0] == last + 3
    assert not _odd_slots(store)
    w = start(writer, store.name, STRESS_SIZES, 10**9)  # until the reader has its reloads
    w.expect("ready")
    reloads, mixed, wrong, *_ = reader.expect("done", timeout=150)
    w.conn.send("stop")
    assert w.expect("done")[0] > last + 3
    assert mixed == 0 and wrong == 0 and reloads >= 300


def test_creator_killed_then_gc(start):
    child = start(create_and_hang, {"a": 1000})
    (name,) = child.expect("created")
    assert name in _segment.list_names()
    os.kill(child.pid, signal.SIGKILL)
    child.proc.join(10)
    ls = json.loads(_cli("ls", "--json"))
    row = next(r for r in ls if r["name"] == name)
    assert row["creator_alive"] is False and row["held"] is False
    # Only this test's store: under xdist other tests' dead-creator stores are theirs to check.
    dry = json.loads(_cli("gc", name, "--dry-run", "--json"))
    assert [r["name"] for r in dry["removed"]] == [name]
    assert name in _segment.list_names(), "--dry-run removed something"
    json.loads(_cli("gc", name, "--json"))
    assert name not in _segment.list_names()


def test_gc_keeps_stores_in_use(store_factory, start):
    # A store whose creator died but that a live process still holds is kept.
    child = start(create_and_hang, {"a": 10})
    (name,) = child.expect("created")
    held = WeightStore.attach(name)
    os.kill(child.pid, signal.SIGKILL)
    child.proc.join(10)
    assert json.loads(_cli("gc", name, "--json"))["removed"] == []
    held.close()
    assert [r["name"] for r in json.loads(_cli("gc", name, "--json"))["removed"]] == [name]
    # and a store whose creator lives is never garbage
    mine = store_factory(blob_weights({"a": 10}))
    assert json.loads(_cli("gc", mine.name, "--dry-run", "--json"))["removed"] == []


def test_orphaned_reader_learns_the_writer_is_gone(start):
    child = start(create_and_hang, {"a": 10})
    (name,) = child.expect("created")
    store = WeightStore.attach(name)
    try:
        reader = WeightReader(store, Blob({"a": 10}))
        assert reader.wait(0, timeout=10) == 0 and store.publisher_alive()
        os.kill(child.pid, signal.SIGKILL)
        child.proc.join(10)
        began = time.monotonic()
        with pytest.raises(WriterGoneError, match=rf"store '{name}': version 5 will never be published"):
            reader.wait(5, timeout=None)
        assert time.monotonic() - began < 3
        assert not store.publisher_alive()
        row = next(r for r in json.loads(_cli("ls", "--json")) if r["name"] == name)
        assert row["held"] and not row["creator_alive"]
        line = next(line for line in _cli("ls").splitlines() if line.startswith(name))
        assert line.endswith("orphaned")
        assert json.loads(_cli("gc", name, "--json"))["removed"] == []
        assert [r["name"] for r in json.loads(_cli("gc", name, "--orphaned", "--json"))["removed"]] == [name]
        assert name not in _segment.list_names()
        assert reader.version == 0  # the reader keeps its mapping and its weights
    finally:
        store.close()


def test_exit_with_parent(start):
    parent = start(parent_of_a_watching_child, daemon=False)
    (pid,) = parent.expect("watching", timeout=120)  # the handshake: its watch has begun
    child = psutil.Process(pid)
    os.kill(parent.pid, signal.SIGKILL)
    parent.proc.join(10)
    deadline = time.monotonic() + 30  # its watch wakes every 0.2 s; a busy machine may delay it
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    outlived = _running(child)
    if outlived:  # re-parented away from us: no fixture would find it
        child.kill()
    assert not outlived, "the child outlived its parent"


def _running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (an exited child nobody reaped yet is not running)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_ls_table(store_factory):
    store = store_factory(blob_weights({"a": 1000}), name=f"ls-table-{os.getpid()}")
    out = _cli("ls")
    line = next(line for line in out.splitlines() if line.startswith(store.name))
    assert "in use" in line and f"{os.getpid()} (alive)" in line


def _cli(*args):
    proc = subprocess.run([sys.executable, "-m", "shmsync.cli", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


CRASH = """
import os, signal, sys, torch
from shmsync import WeightReader, WeightStore
store = WeightStore.create(torch.nn.Linear(4, 2))
print(store.name, flush=True)
if sys.argv[1] == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
module = torch.nn.Linear(4, 2)
reader = WeightReader(store, module, zero_copy=True)
assert reader.poll() and reader.viewing
with torch.no_grad():
    module.weight.add_(1.0)  # through the read-only view: SIGSEGV
"""


@pytest.mark.parametrize("how, code", [("sigkill", -signal.SIGKILL), ("sigsegv", -signal.SIGSEGV)])
def test_a_creator_that_crashes_leaves_no_store(tmp_path, how, code):
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    proc = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr[-2000:]
    name = proc.stdout.strip()
    deadline = time.monotonic() + 10
    while name in _segment.list_names() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert name not in _segment.list_names(), f"the crashed creator's store {name} is still in {_segment.SHM_DIR}"
