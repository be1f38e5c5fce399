"""Crash safety with real processes and SIGKILL."""

import json
import os
import signal
import threading
import time

import pytest

from shmsync import WeightReader, WeightStore, WriterGoneError
from shmsync.core import segment
from shmsync.core.header import B_SEQ, HOST, bank_word
from shmsync.testing import read_header_word
from tests.commands import cli, python, run_command
from tests.processes import create_and_hang, promise_and_stop_mid_copy, stress_reader, writer, writer_killed_mid_copy
from tests.waiting import START_S, STUCK_S
from tests.weights import STRESS_SIZES, Blob, blob_weights, mixed_values

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * START_S + 120)]


def _odd_slots(store):
    return [i for i in range(store.memory.num_slots) if read_header_word(store, bank_word(HOST, B_SEQ + i)) & 1]


def test_writer_killed_mid_publish(store_factory, start):
    store = store_factory(blob_weights(STRESS_SIZES, 0.0))
    store.release_writer()
    reader = start(stress_reader, store, STRESS_SIZES, 40)
    reader.expect("ready")
    for attempt in range(2):
        w = start(writer_killed_mid_copy, store.name, STRESS_SIZES, 5 + attempt)
        version, slot = w.expect("mid-copy", timeout=START_S)  # the handshake: it is inside a copy
        os.kill(w.pid, signal.SIGKILL)
        w.proc.join(10)
        assert _odd_slots(store) == [slot], "the killed write did not leave its slot marked being written"
        # Readers stay on the last complete version, whose contents are whole.
        snap = store.snapshot()
        assert snap.version == store.version == version
        assert all((t == float(snap.version)).all() for t in snap.weights.values())
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
    assert mixed == 0 and wrong == 0 and reloads >= 40


def test_orphaned_reader_learns_the_writer_is_gone(start):
    child = start(create_and_hang, {"a": 10})
    (name,) = child.expect("created")
    store = WeightStore.attach(name)
    try:
        reader = WeightReader(store, Blob({"a": 10}))
        assert reader.wait(0, timeout=10) == 0 and store.writer_alive()
        os.kill(child.pid, signal.SIGKILL)
        child.proc.join(10)
        began = time.monotonic()
        with pytest.raises(WriterGoneError, match=rf"store '{name}': version 5 will never be published"):
            reader.wait(5, timeout=None)  # no timeout: a reader that missed the death would hang
        assert time.monotonic() - began < STUCK_S
        assert not store.writer_alive()
        row = next(r for r in json.loads(cli("ls", "--json").stdout) if r["name"] == name)
        assert row["held"] and not row["creator_alive"]
        line = next(line for line in cli("ls").stdout.splitlines() if line.startswith(name))
        assert line.endswith("orphaned")
        assert json.loads(cli("gc", name, "--json").stdout)["removed"] == []
        assert [r["name"] for r in json.loads(cli("gc", name, "--orphaned", "--json").stdout)["removed"]] == [name]
        assert name not in segment.list_names()
        assert reader.version == 0  # the reader keeps its mapping and its weights
    finally:
        store.close()


def test_a_trainer_killed_while_its_promised_version_is_copied_lets_its_workers_go_in_a_second(start):
    """A worker waiting for a promised version learns within a second that its trainer died in the
    middle of that copy (a named error), and keeps the newest whole version."""
    child = start(promise_and_stop_mid_copy, {"a": 1 << 20, "b": 1 << 20})
    name, promised = child.expect("mid-copy", timeout=60)
    store = WeightStore.attach(name)
    try:
        module = Blob({"a": 1 << 20, "b": 1 << 20})
        reader = WeightReader(store, module)
        reader.poll()
        assert (reader.version, promised) == (0, 1)
        ended: dict = {}

        def wait():
            try:
                reader.poll_promised(timeout=30)
            except Exception as e:
                ended["error"] = e
            ended["at"] = time.monotonic()

        waiting = threading.Thread(target=wait)
        waiting.start()
        time.sleep(0.5)
        assert waiting.is_alive(), "the worker did not wait for the promised version"
        killed = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        child.proc.join(10)
        waiting.join(10)
        assert isinstance(ended.get("error"), WriterGoneError), ended
        assert "version 1, promised by the trainer's last publish, will never be published" in str(ended["error"])
        assert ended["at"] - killed < 1.0, f"the worker learned it {ended['at'] - killed:.2f} s after the kill"
        assert reader.version == 0 and mixed_values(module) == {0.0}
    finally:
        store.unlink()  # orphaned: its creator died (`shmsync gc --orphaned` does the same)
        store.close()


CRASH = """
import ctypes, faulthandler, os, signal, sys, torch
from shmsync import WeightStore
store = WeightStore.create(torch.nn.Linear(4, 2))
print(store.name, flush=True)
if sys.argv[1] == "sigkill":
    os.kill(os.getpid(), signal.SIGKILL)
faulthandler.disable()
ctypes.string_at(0)  # a crash in C code: SIGSEGV
"""


@pytest.mark.parametrize("how, code", [("sigkill", -signal.SIGKILL), ("sigsegv", -signal.SIGSEGV)])
def test_a_creator_that_crashes_leaves_no_store(tmp_path, how, code):
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    proc = run_command(python(str(script), how))
    assert proc.returncode == code, proc.stderr[-2000:]
    name = proc.stdout.strip()
    deadline = time.monotonic() + STUCK_S
    while name in segment.list_names() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert name not in segment.list_names(), f"the crashed creator's store {name} is still in {segment.SHM_DIR}"
