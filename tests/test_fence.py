"""Memory fences: both orderings are real and the switch between them is checked."""

import pytest


def test_the_ordering_switch_is_checked(monkeypatch):
    from shmsync import _fence

    monkeypatch.setenv("SHMSYNC_ORDERING", "weak")
    assert _fence.default_ordering() == "weak"
    fence, full = _fence.ordering()
    assert fence is full and fence is not _fence._noop
    monkeypatch.setenv("SHMSYNC_ORDERING", "relaxed")
    with pytest.raises(ValueError, match="SHMSYNC_ORDERING must be 'tso' or 'weak'"):
        _fence.default_ordering()
