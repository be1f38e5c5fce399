"""``shmsync ls`` and ``shmsync gc``: their output, and a store folder holding things that are not
stores (a FIFO, a directory, a socket, a link, another user's file, forged names), which they
skip with a line saying why, never hang on, never crash on and never remove."""

import json
import os
import socket
import time

import pytest
import torch

from shmsync import WeightStore, _segment

from helpers import cli

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def store_dir(tmp_path, monkeypatch):
    path = tmp_path / "shm"
    path.mkdir()
    monkeypatch.setattr(_segment, "SHM_DIR", str(path))
    return path


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
