"""The examples run end to end with tiny budgets."""

import os
import re
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.commands import CHECKOUT, cli, python, run_script, start_command

# Each runs an interpreter of its own (seconds); those marked `torchrl` run a TorchRL example.
pytestmark = [pytest.mark.slow]


ROOT = CHECKOUT


@pytest.mark.timeout(120)
def test_quickstart():
    out = run_script("examples/quickstart.py")
    assert "trainer: step 40, published version 8" in out
    for worker in (0, 1):
        assert f"worker {worker}: loaded version 8" in out
        # Each load is of a newer version, ending at the last published. How many of the versions
        # along the way a worker catches depends on the scheduler, not on shmsync.
        # (Found anywhere in the output: the processes' lines may interleave mid-line.)
        seen = [int(v) for v in re.findall(rf"worker {worker}: loaded version (\d+)", out)]
        assert seen == sorted(set(seen)) and seen[-1] == 8, f"worker {worker} loaded {seen}"


@pytest.mark.torchrl
@pytest.mark.timeout(300)
# The default, and the other collector with the other reload (the scheme's own tests cover
# each alone); `--scheme torchrl` runs TorchRL's own scheme, which the example only times.
@pytest.mark.parametrize(
    "mode",
    [
        pytest.param([], id="default"),
        pytest.param(["--async", "--private-copy"], id="async-private-copy", marks=pytest.mark.full),
    ],
)
def test_train_cartpole_tiny_budget(mode, tmp_path):
    out = run_script(
        "examples/train_cartpole.py",
        "--total-frames",
        "512",
        "--frames-per-batch",
        "128",
        "--optim-steps-per-batch",
        "4",
        "--eval-every",
        "2",
        "--eval-episodes",
        "1",
        "--target-return",
        "0",
        "--no-progress",
        "--log-dir",
        str(tmp_path),
        *mode,
    )
    assert "evaluation" in out and "frames/s" in out
    # LogLag wrote the lag of every batch (4) to the trainer's CSV logger.
    lag = (tmp_path / "cartpole" / "scalars" / "policy_lag" / "frames_max.csv").read_text().split()
    assert len(lag) == 4 and all(float(line.split(",")[1]) >= 0 for line in lag)
    # The table, taken once training stopped, agrees with the summary: version 4, published after
    # the last batch, which no worker ran.
    assert "versions published   4 (the last one after the final batch)" in out
    assert "readers' table when training stopped:" in out and re.search(r": version 4, 2 readers on 1 host", out), out
    assert "staleness of frames" in out
    if mode == []:
        assert "versions per worker  [4, 4]" in out
    else:
        assert "private copies" in out


@pytest.mark.torchrl
@pytest.mark.full  # make test runs standalone workers in docs/getting-started.md's block and tests/workers
@pytest.mark.timeout(240)
def test_train_with_workers_tiny_budget():
    out = run_script(
        "examples/train_with_workers.py",
        "--max-batches",
        "4",
        "--eval-every",
        "2",
        "--optim-steps-per-batch",
        "2",
        "--target-return",
        "0",  # never stop early, as in train_cartpole.py (an evaluation return is always >= 0)
    )
    assert "batch    2" in out and "batch    4" in out and "versions published" in out and "staleness of frames" in out
    assert re.search(r"store (\S+): watch its workers live with  shmsync ls \1 --watch", out)


def _start_demo(optim_steps_per_batch: int, *extra: str) -> subprocess.Popen:
    """The demo with --keep-running, in its own process group: a terminal's Ctrl-C reaches the
    demo and its workers together."""
    cmd = python("examples/train_cartpole.py", "--keep-running", "--frames-per-batch", "128", *extra)
    cmd += ["--optim-steps-per-batch", str(optim_steps_per_batch), "--eval-every", "2", "--eval-episodes", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return start_command(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, new_session=True)


def _kill_demo(proc: subprocess.Popen) -> None:
    """Whatever a test found: the demo and its workers are gone after it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.torchrl
@pytest.mark.timeout(180)
def test_the_demo_says_how_to_watch_it_and_keeps_running_until_ctrl_c():
    # --keep-running trains past any frame budget: here one of 256 frames, two batches.
    proc = _start_demo(2, "--total-frames", "256")
    try:
        assert proc.stdout.readline().startswith("DQN on CartPole-v1: MultiSyncCollector, 2 workers")
        head = [proc.stdout.readline(), proc.stdout.readline()]
        name = re.match(r"store (\S+): watch its workers live", head[0]).group(1)
        assert head[1].split()[-4:] == ["shmsync", "ls", name, "--watch"], head
        progress = [proc.stdout.readline() for _ in range(4)]  # three evaluations (and TorchRL's one line)
        frames = [int(m.group(1)) for m in map(re.compile(r"frames +(\d+) until Ctrl-C").search, progress) if m]
        assert frames and max(frames) > 256, progress
        listing = cli("ls", name)
        assert listing.stdout.startswith(f"{name}: version ") and ", 2 readers on 1 host" in listing.stdout
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        _kill_demo(proc)
    assert proc.returncode == 0 and "--- summary ---" in out, out[-3000:]
    assert re.search(r"stopped by Ctrl-C after \d+ frames", out) and "reached" not in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def _demo_with_a_ctrl_c(delay: float) -> tuple[int, str]:
    """Run the demo until Ctrl-C, pressed (SIGINT to its process group, as a terminal does)
    ``delay`` seconds after it said it started; its exit code and output."""
    proc = _start_demo(16)
    try:
        first = proc.stdout.readline()  # the demo's first line: training starts
        assert first.startswith("DQN on CartPole-v1"), first
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
        return proc.returncode, first + out
    finally:
        _kill_demo(proc)


# Seconds after the demo said it started: from inside the collector's start to training well under
# way (the loss, the optimizer step, an evaluation). `make test` presses at 2 of them (the demo's
# --keep-running test presses once more, mid-training), `make test-full` at all 20.
@pytest.mark.torchrl
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "delays",
    [  # make test presses Ctrl-C once, in test_the_demo_says_how_to_watch_it_and_keeps_running_until_ctrl_c
        pytest.param([0.0, 3.5], id="2", marks=pytest.mark.full),
        pytest.param([0.35 * i for i in range(20)], id="20", marks=pytest.mark.full),
    ],
)
def test_a_ctrl_c_pressed_at_any_point_ends_the_demo_with_its_summary(delays):
    """Wherever the press lands, the demo stops after the batch at hand, prints its summary, says it
    was stopped, exits 0, with no traceback."""
    failed = []
    with ThreadPoolExecutor(2) as pool:  # two demos at a time: each waits on its workers' start often
        for delay, (code, out) in zip(delays, pool.map(_demo_with_a_ctrl_c, delays)):
            whole = code == 0 and "--- summary ---" in out and "Traceback" not in out and " 0 frames/s" not in out
            if not (whole and re.search(r"stopped by Ctrl-C after \d+ frames", out)):
                failed.append(f"Ctrl-C at {delay:.2f} s: exit {code}\n{out[-2000:]}")
    assert not failed, f"{len(failed)} of {len(delays)} runs failed:\n" + "\n\n".join(failed)


@pytest.mark.torchrl
@pytest.mark.full  # the scheme's tests cover its collector; the demo's default run stays
@pytest.mark.timeout(300)
def test_train_async_tiny_budget():
    out = run_script(
        "examples/train_async.py",
        "--total-frames",
        "768",
        "--optim-steps-per-batch",
        "2",
        "--eval-every",
        "2",
        "--max-staleness",
        "4",
    )
    steps = int(out.split("optimizer steps       ", 1)[1].split()[0])
    skipped = int(out.split("batches with no fresh frames  ", 1)[1].split()[0])
    assert 0 < steps <= 12 and steps + 2 * skipped >= 12, out  # 6 batches, 2 steps each unless all stale
    staleness = float(out.split("staleness of batches  mean ", 1)[1].split()[0])
    assert 0 <= staleness <= 12, out


@pytest.mark.torchrl
@pytest.mark.timeout(240)
def test_frozen_backbone_copies_what_changed_and_runs_exact_versions():
    out = run_script(
        "examples/frozen_backbone.py", "--backbone-mb", "8", "--batches", "10", "--refresh-every", "4", timeout=200
    )
    assert "batches that ran exactly their version's weights  10 of 10" in out, out
    # Each batch ran the newest weights: the update, then the training, published at the hand-out.
    assert out.count(" 0 optimizer steps behind") == 10, out
    share = float(re.search(r"publishes copied .* \((\d+\.\d)%\)", out).group(1))
    assert share < 50, out  # the frozen backbone was copied into the first slots only
