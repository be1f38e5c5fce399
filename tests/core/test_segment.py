"""Store files as untrusted input: names, file types, owners and modes, checked before anything
is mapped; every refusal a shmsync error naming what is wrong, with no descriptor left open."""

import os
import re
import socket
import stat

import pytest
import torch

from shmsync import WeightStore
from shmsync.errors import StoreUntrustedError
from shmsync.relay.raw_versions import create_from_bytes
from tests.commands import python, run_command
from tests.core.descriptors import open_fds


def _a_store_file(store_dir, name="victim"):
    """A valid store's file, no longer held by this process."""
    store = WeightStore.create(torch.nn.Linear(4, 2), name=name, unlink_at_exit=False)
    store.close()
    return store_dir / f"shmsync-{name}"


@pytest.mark.parametrize(
    "name", ["", "a/b", "caf\u00e9", "a:b", "new\nline", ".hidden", "-dash", "x" * 201, "tab\there", "\x1b[31m"]
)
def test_names_outside_the_safe_set_are_refused_on_create_and_attach(store_dir, name):
    with pytest.raises(ValueError, match="invalid store name"):
        WeightStore.create(torch.nn.Linear(1, 1), name=name)
    with pytest.raises(ValueError, match="invalid store name"):
        WeightStore.attach(name)
    assert os.listdir(store_dir) == []


def test_the_safe_set_takes_what_stores_are_named_by(store_dir):
    for name in ["policy", "torchrl-3f2a9c01b7e4-w0", "1234-abcdef", "a.b_c-d", "_x", "x" * 200]:
        with WeightStore.create(torch.nn.Linear(1, 1), name=name) as store:
            assert WeightStore.attach(name).version == store.version == 0


def _fifo(path):
    os.mkfifo(path)


def _directory(path):
    path.mkdir()


def _socket(path):
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(path))
    return sock


@pytest.mark.timeout(30)
@pytest.mark.parametrize("make, kind", [(_fifo, "a FIFO"), (_directory, "a directory"), (_socket, "a socket")])
def test_a_file_of_another_kind_is_refused_without_blocking(store_dir, make, kind):
    keep = make(store_dir / "shmsync-policy")
    before = open_fds(store_dir)
    with pytest.raises(StoreUntrustedError, match=kind):
        WeightStore.attach("policy")
    assert open_fds(store_dir) == before
    del keep


def test_a_symbolic_link_is_not_followed(store_dir):
    target = _a_store_file(store_dir, "real")
    os.symlink(target, store_dir / "shmsync-policy")
    before = open_fds(store_dir)
    with pytest.raises(StoreUntrustedError, match="symbolic link"):
        WeightStore.attach("policy")
    assert open_fds(store_dir) == before
    assert WeightStore.attach("real").version == 0  # the store itself is fine


@pytest.mark.parametrize("mode, why", [(0o666, "every user of this host may write it"), (0o620, "its group may write")])
def test_a_file_others_may_write_is_refused(store_dir, mode, why):
    path = _a_store_file(store_dir)
    os.chmod(path, mode)
    before = open_fds(store_dir)
    with pytest.raises(StoreUntrustedError, match=why):
        WeightStore.attach("victim")
    assert open_fds(store_dir) == before


def test_a_group_shared_store_needs_the_opt_in_on_both_sides(store_dir, monkeypatch):
    monkeypatch.setenv("SHMSYNC_TRUST_GROUP", "1")
    with WeightStore.create(torch.nn.Linear(4, 2), name="shared") as store:
        path = store_dir / "shmsync-shared"
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
        assert WeightStore.attach("shared").version == store.version
        monkeypatch.delenv("SHMSYNC_TRUST_GROUP")
        with pytest.raises(StoreUntrustedError, match="SHMSYNC_TRUST_GROUP=1"):
            WeightStore.attach("shared")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file of another user")
def test_a_file_of_another_user_is_refused(store_dir, monkeypatch):
    path = _a_store_file(store_dir)
    os.chown(path, 65534, 65534)  # nobody
    with pytest.raises(StoreUntrustedError, match="owned by uid 65534"):
        WeightStore.attach("victim")
    monkeypatch.setenv("SHMSYNC_TRUST_GROUP", "1")  # nobody's group is not ours either
    with pytest.raises(StoreUntrustedError, match="owned by uid 65534"):
        WeightStore.attach("victim")


def test_a_store_made_under_a_temporary_name_appears_whole_or_not_at_all(store_dir):
    source = WeightStore.create(torch.nn.Linear(4, 2), name="source")
    seen = []

    def fill(buffer, write):
        seen.append(os.listdir(store_dir))
        buffer[:] = b"\x01" * len(buffer)

    store = create_from_bytes(source.memory.layout_description, fill, version=7, name="made")
    try:
        (incoming,) = set(seen[0]) - {"shmsync-source"}  # mid-fill: only a temporary name
        assert incoming.startswith("shmsync-.incoming-")
        assert sorted(os.listdir(store_dir)) == ["shmsync-made", "shmsync-source"]
        assert WeightStore.attach("made").version == 7
    finally:
        store.close()
        source.close()

    def failing(buffer, write):
        raise RuntimeError("the peer went away")

    with pytest.raises(RuntimeError, match="went away"):
        create_from_bytes(source.memory.layout_description, failing, version=1, name="never")
    assert os.listdir(store_dir) == []


def test_a_default_store_name_says_which_program_and_process_made_it(tmp_path):
    script = tmp_path / "train my policy.py"
    script.write_text(
        "import os, sys\n"
        "from shmsync.core.segment import default_name, validate_name\n"
        "name = default_name('torchrl')\n"
        "print(name == validate_name(name), name.startswith(f'train-my-policy-torchrl-{os.getpid()}-'))\n"
    )
    proc = run_command(python(str(script)))
    assert proc.stdout.split() == ["True", "True"], proc.stderr
    proc = run_command(python("-c", "from shmsync.core.segment import default_name; print(default_name())"))
    assert re.fullmatch(r"python-\d+-[0-9a-f]{6}\n", proc.stdout), proc.stdout + proc.stderr
