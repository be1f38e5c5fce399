"""The relay's secret (shmsync/tools/secret_file.py): where it comes from, how short it may be, and
`shmsync new-secret`, which writes one only its owner can read and never replaces a file."""

from __future__ import annotations

import os

import pytest

from shmsync.tools import secret_file
from tests.commands import cli


def test_the_secret_comes_from_an_argument_the_environment_or_a_private_file(tmp_path, monkeypatch):
    monkeypatch.delenv(secret_file.SECRET_ENV, raising=False)
    monkeypatch.delenv(secret_file.SECRET_FILE_ENV, raising=False)
    with pytest.raises(ValueError, match="no relay secret"):
        secret_file.resolve_secret()
    generated, made = secret_file.resolve_secret(generate=True)
    assert made and len(generated) == 43, "a generated secret is 32 random bytes, URL-safe"
    monkeypatch.setenv(secret_file.SECRET_ENV, "x" * 40)
    assert secret_file.resolve_secret() == (b"x" * 40, False)
    monkeypatch.delenv(secret_file.SECRET_ENV)
    path = tmp_path / "secret"
    path.write_text("y" * 40 + "\n")
    monkeypatch.setenv(secret_file.SECRET_FILE_ENV, str(path))
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError, match="only you can read"):
        secret_file.resolve_secret()
    os.chmod(path, 0o600)
    assert secret_file.resolve_secret() == (b"y" * 40, False)


@pytest.mark.parametrize("short", ["passwordpassword", "correct horse battery staple!!!"])
def test_a_secret_given_by_hand_shorter_than_32_bytes_is_refused_without_being_echoed(short):
    with pytest.raises(ValueError, match=r"is \d+ bytes; a relay secret must be 32 to 4096 random bytes") as info:
        secret_file.resolve_secret(short)
    assert short not in str(info.value)


def test_new_secret_writes_a_random_secret_only_its_owner_can_read_and_never_replaces_a_file(tmp_path):
    loose = tmp_path / "under-a-loose-umask"
    old = os.umask(0)
    try:
        secret_file.write_secret_file(str(loose))
    finally:
        os.umask(old)
    assert os.stat(loose).st_mode & 0o777 == 0o600, "the umask loosened the secret file's mode"
    path = tmp_path / "relay-secret"
    out = cli("new-secret", str(path))
    assert "mode 0600" in out.stdout
    st = os.stat(path)
    assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()
    first = secret_file.read_secret_file(str(path))
    assert len(first) == 43 and secret_file.resolve_secret(first) == (first, False)
    again = cli("new-secret", str(path), check=False)
    assert again.returncode == 1 and "File exists" in again.stderr and "Traceback" not in again.stderr
    assert secret_file.read_secret_file(str(path)) == first, "an existing secret file was replaced"
    other = tmp_path / "another"
    cli("new-secret", str(other))
    assert secret_file.read_secret_file(str(other)) != first
