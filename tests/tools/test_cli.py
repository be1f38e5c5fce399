"""``shmsync ls`` and ``shmsync gc``: their output, and a store folder holding things that are not
stores (a FIFO, a directory, a socket, a link, another user's file, forged names), which they
skip with a line saying why, never hang on, never crash on and never remove."""

import json
import os
import signal
import socket
import time

import pytest
import torch

from shmsync import WeightReader, WeightStore
from tests.commands import cli, python
from tests.processes import use_store_dir
from tests.relay.peers import SECRET

pytestmark = pytest.mark.timeout(120)


def _env(store_dir):
    return {**os.environ, "SHMSYNC_DIR": str(store_dir)}


def test_ls_shows_each_store_in_use(store_factory):
    store = store_factory(torch.nn.Linear(4, 2), name=f"ls-table-{os.getpid()}")
    out = cli("ls").stdout
    line = next(line for line in out.splitlines() if line.startswith(store.name))
    assert "in use" in line and f"{os.getpid()} (alive)" in line
    row = next(r for r in json.loads(cli("ls", "--json").stdout) if r["name"] == store.name)
    assert row["held"] and row["creator_alive"] and row["writer_held"] and row["valid"]


def test_a_folder_of_things_that_are_not_stores(store_dir):
    live = WeightStore.create(torch.nn.Linear(4, 2), name="live")
    keep = []
    try:
        os.mkfifo(store_dir / "shmsync-fifo")
        (store_dir / "shmsync-dir").mkdir()
        keep.append(socket.socket(socket.AF_UNIX))
        keep[-1].bind(str(store_dir / "shmsync-sock"))
        os.symlink(store_dir / "shmsync-live", store_dir / "shmsync-link")
        forged = "x\nforged  99  1.0 MiB  in use\x1b[2J"
        (store_dir / f"shmsync-{forged}").write_bytes(b"\0" * 100)
        (store_dir / "shmsync-corrupt").write_bytes(os.urandom(4096))  # ours, unheld, old
        old = time.time() - 3600
        os.utime(store_dir / "shmsync-corrupt", (old, old))
        if os.geteuid() == 0:
            WeightStore.create(torch.nn.Linear(4, 2), name="theirs", unlink_at_exit=False).close()
            os.chown(store_dir / "shmsync-theirs", 65534, 65534)

        proc = cli("ls", env=_env(store_dir), timeout=30)  # a FIFO opened for reading would hang it
        rows = proc.stdout.splitlines()
        assert [r.split()[0] for r in rows[1:]] == ["corrupt", "live"], proc.stdout  # oldest first
        assert "incomplete garbage" in rows[1] and "in use" in rows[2]
        skipped = proc.stderr.splitlines()
        why = {
            "fifo": "a FIFO",
            "dir": "a directory",
            "sock": "a socket",
            "link": "a symbolic link",
            "x\\nforged": "not a valid store name",
        }
        if os.geteuid() == 0:
            why["theirs"] = "owned by uid 65534"
        assert len(skipped) == len(why), proc.stderr
        for name, reason in why.items():
            assert any(f"'shmsync-{name}" in line and reason in line for line in skipped), (name, proc.stderr)
        assert "\x1b" not in proc.stdout + proc.stderr, "an escape sequence reached the terminal"
        assert not any(line.startswith("forged") for line in proc.stdout.splitlines() + skipped)

        assert [r["name"] for r in json.loads(cli("ls", "--json", env=_env(store_dir)).stdout)] == ["corrupt", "live"]
        out = json.loads(cli("gc", "--orphaned", "--json", env=_env(store_dir), timeout=30).stdout)
        assert [r["name"] for r in out["removed"]] == ["corrupt"]
        left = sorted(os.listdir(store_dir))
        expected = ["fifo", "dir", "sock", "link", forged, "live"] + (["theirs"] if os.geteuid() == 0 else [])
        assert left == sorted(f"shmsync-{n}" for n in expected), "gc removed something that is not its own"
    finally:
        live.close()
        for sock in keep:
            sock.close()


def test_gc_removes_only_the_named_stores_and_dry_run_removes_nothing(store_dir):
    for name in ("a", "b"):
        WeightStore.create(torch.nn.Linear(4, 2), name=name, unlink_at_exit=False).close()
    dry = json.loads(cli("gc", "a", "--dry-run", "--json", env=_env(store_dir)).stdout)
    assert [r["name"] for r in dry["removed"]] == ["a"] and sorted(os.listdir(store_dir)) == ["shmsync-a", "shmsync-b"]
    assert "removed a" in cli("gc", "a", env=_env(store_dir)).stdout
    assert os.listdir(store_dir) == ["shmsync-b"]
    assert cli("ls", env=_env(store_dir)).stdout.splitlines()[1].split()[-1] == "garbage"


def _hold(store_dir, name, worker, conn):
    """A reader of store ``name`` in ``store_dir`` as worker ``worker``, loaded; waits to be killed."""
    use_store_dir(store_dir)
    store = WeightStore.attach(name)
    reader = WeightReader(store, torch.nn.Linear(4, 2), worker=worker)
    reader.poll()
    conn.send(("loaded", reader.version))
    time.sleep(3600)


@pytest.mark.slow
def test_ls_name_lists_every_reader_worst_first_in_text_and_json(store_dir, start):
    policy = torch.nn.Linear(4, 2)
    with WeightStore.create(policy, name="policy") as store:
        first = start(_hold, str(store_dir), "policy", 0)
        first.expect("loaded")
        store.publish(policy)
        second = start(_hold, str(store_dir), "policy", 1)
        second.expect("loaded")
        out = cli("ls", "policy", env=_env(store_dir)).stdout.splitlines()
        assert out[0].startswith("policy: version 1, 2 readers on 1 host; 1 reader behind (worst: 1 version, worker 0")
        assert out[1].split()[:5] == ["HOST", "WORKER", "PID", "VERSION", "BEHIND"]
        assert [line.split()[1:5] for line in out[2:]] == [
            ["0", str(first.pid), "0", "1"],
            ["1", str(second.pid), "1", "0"],
        ]
        doc = json.loads(cli("ls", "policy", "--json", env=_env(store_dir)).stdout)
        assert set(doc) == {"store", "version", "taken_ns", "readers", "gone", "hosts"}
        assert [(r["worker"], r["pid"], r["version"], r["behind"], r["mode"]) for r in doc["readers"]] == [
            (0, first.pid, 0, 1, "in place"),  # CPU readers run on the store in place
            (1, second.pid, 1, 0, "in place"),
        ]
        assert all(r["state"] in ("sleeping", "running") and r["uss"] > 0 for r in doc["readers"])


def _readers_column(listing, name):
    lines = listing.splitlines()
    at = lines[0].index("READERS")  # columns are aligned; some cells hold spaces ("144.0 KiB")
    return next(line for line in lines if line.startswith(name))[at:].split()[0]


def test_ls_and_ls_name_count_the_same_readers_beside_a_relay_link(store_dir):
    # A trainer's RelaySender holds a row of the table for its link: no reader, in both views.
    from shmsync.relay import RelaySender

    store = WeightStore.create(torch.nn.Linear(4, 2), name="relayed")
    with store, RelaySender(store, "127.0.0.1", 0, secret=SECRET):
        reader = WeightReader(store, torch.nn.Linear(4, 2))
        reader.poll()
        count = _readers_column(cli("ls", env=_env(store_dir)).stdout, "relayed")
        head = cli("ls", "relayed", env=_env(store_dir)).stdout.splitlines()[0]
        assert count == "1" and head.startswith("relayed: version 0, 1 reader"), (count, head)
        reader.close()


def test_ls_of_an_unknown_store_names_the_close_ones_in_one_line(store_dir):
    with WeightStore.create(torch.nn.Linear(4, 2), name="policy-main"):
        proc = cli("ls", "policy-mian", env=_env(store_dir), check=False)
    assert proc.returncode == 3 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert "no store named 'policy-mian'" in proc.stderr and "did you mean 'policy-main'" in proc.stderr
    proc = cli("ls", "nothing", env=_env(store_dir), check=False)
    assert proc.returncode == 3 and "has the trainer created it yet?" in proc.stderr
    proc = cli("ls", "../etc", env=_env(store_dir), check=False)
    assert proc.returncode == 2 and "invalid store name" in proc.stderr


@pytest.mark.slow
def test_an_unlinked_store_stays_listed_while_a_process_holds_it(store_dir, start):
    policy = torch.nn.Linear(4, 2)
    store = WeightStore.create(policy, name="gone-from-folder")
    try:
        holder = start(_hold, str(store_dir), "gone-from-folder", 3)
        holder.expect("loaded")
        store.unlink()
        assert os.listdir(store_dir) == []
        line = cli("ls", env=_env(store_dir)).stdout.splitlines()[1]
        assert line.startswith("gone-from-folder") and line.endswith("in use, unlinked")
        out = cli("ls", "gone-from-folder", env=_env(store_dir)).stdout.splitlines()
        assert out[2].split()[1:3] == ["3", str(holder.pid)]
        store.close()  # the trainer goes: its reader still holds the store
        line = cli("ls", env=_env(store_dir)).stdout.splitlines()[1]
        assert line.endswith("orphaned, unlinked")
        assert cli("gc", "--orphaned", env=_env(store_dir)).stdout.endswith("removed 0 store(s)\n")
        holder.proc.kill()
        holder.proc.join(10)
        assert cli("ls", env=_env(store_dir)).stdout == "no shmsync stores on this host\n"
    finally:
        store.close()


def test_watch_redraws_in_a_terminal_until_ctrl_c(store_dir):
    import pty
    import select

    with WeightStore.create(torch.nn.Linear(4, 2), name="policy") as store:
        pid, fd = pty.fork()
        if pid == 0:  # the child: the command, its terminal the pty
            # As a shell starts a foreground command: Ctrl-C's signal delivered and not ignored,
            # whatever an earlier test left in this process (an ignored or blocked SIGINT is inherited).
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
            command = python("-m", "shmsync", "ls", "policy", "--watch", "0.2")
            os.execve(command[0], command, _env(store_dir))
        try:
            seen, deadline = b"", time.monotonic() + 60
            while seen.count(b"Ctrl-C to stop") < 3:
                assert time.monotonic() < deadline, f"the screen was not redrawn: {seen[-500:]!r}"
                if select.select([fd], [], [], 1.0)[0]:
                    seen += os.read(fd, 65536)
                if seen.count(b"Ctrl-C to stop") == 1:
                    store.publish(torch.nn.Linear(4, 2))
            assert b"\x1b[H\x1b[2J" in seen and b"policy: version 1, 0 readers" in seen
            os.write(fd, b"\x03")  # Ctrl-C, through the terminal
            # Read on while waiting: a child whose terminal is full blocks in its write and never exits.
            rest, status, deadline = b"", None, time.monotonic() + 30
            while status is None or select.select([fd], [], [], 0.5)[0]:
                assert time.monotonic() < deadline, f"the command went on after Ctrl-C: {rest[-500:]!r}"
                if status is None:
                    done, code = os.waitpid(pid, os.WNOHANG)
                    if done:
                        status, pid = code, 0
                if select.select([fd], [], [], 0.1)[0]:
                    try:
                        chunk = os.read(fd, 65536)
                    except OSError:  # the terminal closed with the child
                        chunk = b""
                    if not chunk and status is not None:
                        break
                    rest += chunk
            assert os.waitstatus_to_exitcode(status) == 0
            assert b"Traceback" not in seen + rest
        finally:
            if pid:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
            os.close(fd)
