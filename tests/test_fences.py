"""Memory fences: both orderings are real and the switch between them is checked."""

import pytest


def test_the_ordering_switch_is_checked(monkeypatch):
    from shmsync.core import fences

    monkeypatch.setenv("SHMSYNC_ORDERING", "weak")
    assert fences.default_ordering() == "weak"
    fence, full = fences.ordering()
    assert fence is full and fence is not fences._noop
    monkeypatch.setenv("SHMSYNC_ORDERING", "relaxed")
    with pytest.raises(ValueError, match="SHMSYNC_ORDERING must be 'tso' or 'weak'"):
        fences.default_ordering()
