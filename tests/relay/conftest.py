"""The relay tests' fixtures: another host's store folder, and this process made that host."""

from __future__ import annotations

import pytest


@pytest.fixture
def host(tmp_path):
    """Another host's shared memory: a directory of its own."""
    path = tmp_path / "host-b"
    path.mkdir()
    return str(path)


@pytest.fixture
def one_host(host, monkeypatch):
    from shmsync.core import segment

    monkeypatch.setattr(segment, "SHM_DIR", host)  # restored after the test
    return host
