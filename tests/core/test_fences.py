"""Memory fences: both orderings are real, the switch between them is checked, and they come from
a vetted source that writes no executable memory (a process that forbids it runs shmsync as any)."""

import os

import pytest

PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1


def test_the_ordering_switch_is_checked(monkeypatch):
    from shmsync.core import fences

    monkeypatch.setenv("SHMSYNC_ORDERING", "weak")
    assert fences.default_ordering() == "weak"
    fence, full = fences.ordering()
    assert fence is full and fence is not fences._noop
    monkeypatch.setenv("SHMSYNC_ORDERING", "relaxed")
    with pytest.raises(ValueError, match="SHMSYNC_ORDERING must be 'tso' or 'weak'"):
        fences.default_ordering()


def test_the_full_fence_is_compiled_or_from_libatomic():
    from shmsync.core import fences

    assert fences.source() in ("extension", "libatomic"), fences.source()
    assert fences._libatomic_fence() is not None or fences.source() == "extension"


def publish_and_reload_without_executable_memory(conn) -> None:
    """Turn on memory-deny-write-execute, then publish and reload (copying and in place), each fence run."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
        conn.send(("skip", f"this kernel has no PR_SET_MDWE ({os.strerror(ctypes.get_errno())})"))
        return
    import mmap

    try:  # the switch is on: a page cannot turn executable
        mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        refused = False
    except OSError:
        refused = True
    import torch

    from shmsync import WeightReader, WeightStore
    from shmsync.core import fences

    policy = torch.nn.Linear(8, 4)
    with WeightStore.create(policy, num_slots=4) as store:
        copying = WeightReader(store, torch.nn.Linear(8, 4))
        viewing = WeightReader(store, torch.nn.Linear(8, 4), zero_copy=True)
        loaded = []
        for _ in range(3):
            with torch.no_grad():
                policy.weight.add_(1.0)
            store.publish(policy)
            copying.poll(), viewing.poll()
            same = torch.equal(copying.module.weight, policy.weight) and torch.equal(
                viewing.module.weight, policy.weight
            )
            loaded.append((copying.version, viewing.version, viewing.viewing, same))
        copying.close(), viewing.close()
    # Sent once the store is closed and unlinked: the test then waits for a clean exit.
    conn.send(("done", refused, fences.source(), loaded))


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_publish_and_reload_under_memory_deny_write_execute(start):
    child = start(publish_and_reload_without_executable_memory)
    if not child.conn.poll(90):
        raise AssertionError("the child said nothing")
    outcome = child.conn.recv()
    if outcome[0] == "skip":
        pytest.skip(outcome[1])
    _, refused, source, loaded = outcome
    child.proc.join(30)
    assert child.proc.exitcode == 0, child.proc.exitcode
    assert refused, "memory-deny-write-execute is on, yet an executable page was made"
    assert source in ("extension", "libatomic"), f"the fence fell back to {source!r}"
    assert loaded == [(1, 1, True, True), (2, 2, True, True), (3, 3, True, True)]
