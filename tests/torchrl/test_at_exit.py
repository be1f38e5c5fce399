"""A script that forgets ``collector.shutdown()``: at exit it says why it would wait, naming the
collector and the fix, and exits (shmsync shuts that collector down), where it would otherwise
hang without a word. A collector that was shut down gets no line: every collector block of the
docs checks that (tests/docs/test_blocks.py)."""

import pytest

from tests.commands import python, run_command, with_tests_importable

SCRIPT = """
from torchrl.collectors import MultiSyncCollector

from shmsync import ShmWeightSyncScheme
from tests.torchrl.collectors import make_linear_policy, make_pendulum


if __name__ == "__main__":
    scheme = ShmWeightSyncScheme()
    forgotten = MultiSyncCollector(
        [make_pendulum], make_linear_policy(0.0), frames_per_batch=20, total_frames=-1,
        weight_sync_schemes={"policy": scheme},
    )
    next(iter(forgotten))
    forgotten.update_policy_weights_()
    print("stores:", scheme.store.name, flush=True)
    print("the last line", flush=True)
"""


@pytest.mark.slow
@pytest.mark.torchrl
@pytest.mark.timeout(300)
def test_a_collector_left_running_is_named_and_shut_down_at_exit(tmp_path):
    script = tmp_path / "forgot_shutdown.py"
    script.write_text(SCRIPT)
    proc = run_command(python(str(script)), cwd=tmp_path, env=with_tests_importable(), timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1] == "the last line", proc.stdout
    store = proc.stdout.splitlines()[-2].removeprefix("stores: ")
    said = [line for line in proc.stderr.splitlines() if line.startswith("shmsync:")]
    assert len(said) == 1, proc.stderr[-3000:]
    assert said[0].startswith(f"shmsync: MultiSyncCollector 'forgotten' (store {store}) was never shut down"), said
    assert "Call forgotten.shutdown() when done with it, in a try/finally around its loop." in said[0], said
    assert "leaked" not in proc.stderr, proc.stderr[-3000:]  # its store went with it
