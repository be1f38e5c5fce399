"""The relay tests' fixtures: this process made another host (``host``, the folder of that host's
stores, is the whole suite's: tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture
def one_host(host, monkeypatch):
    from shmsync.core import segment

    monkeypatch.setattr(segment, "SHM_DIR", host)  # restored after the test
    return host
