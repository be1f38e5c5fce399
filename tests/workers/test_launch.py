"""workers/: standalone collector processes attached to a store by name."""

import os
import signal
import time

import psutil
import pytest
import torch

from shmsync.core import segment
from shmsync.errors import StoreNotFoundError
from shmsync.workers.launch import launch
from shmsync.workers.policies import make_env, mlp_policy
from tests.commands import cli, python, run_command
from tests.waiting import START_S, wait_for
from tests.workers.pools import pool_parent

pytestmark = [pytest.mark.slow, pytest.mark.torchrl, pytest.mark.timeout(180)]


def _zero_(module):
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()


@pytest.mark.parametrize(
    "env, zero_copy", [("CartPole-v1", False), pytest.param("Pendulum-v1", True, marks=pytest.mark.full)]
)
def test_workers_reload_lazily_and_tag_frames(store_factory, env, zero_copy):
    policy = mlp_policy(make_env(env))
    store = store_factory(policy, num_slots=4 if zero_copy else 3)
    with launch(store.name, 2, env, frames_per_batch=50, zero_copy=zero_copy) as pool:
        seen = {0: set(), 1: set()}
        published = False
        deadline = time.monotonic() + 120  # a worker may get little CPU while the suite runs beside it
        for worker_id, batch in pool.batches():
            if time.monotonic() > deadline:
                break
            versions = batch["policy_version"]
            seen[worker_id].update(versions.unique().tolist())
            if env == "CartPole-v1":
                ties = (batch["action"] == 1).all(-1)  # zero weights: both Q-values equal
                assert ties[versions == 1].all() and not ties[versions == 0].any()
            else:
                zero = batch["action"].abs().sum(-1) == 0
                assert zero[versions == 1].all() and not zero[versions == 0].any()
            if not published and len(seen[0]) and len(seen[1]):
                _zero_(policy)
                store.publish(policy)
                published = True
            if all(1 in s for s in seen.values()):
                break
        assert all(1 in s for s in seen.values()), f"a worker never loaded version 1: {seen}"
        assert {r.pid for r in store.readers()} == set(pool.pids)
        assert sorted(r.worker for r in store.readers()) == [0, 1], "each worker's row names it"
        assert all(r.zero_copy == zero_copy for r in store.readers())
        codes = pool.stop()
    assert codes == {0: 0, 1: 0}, f"SIGTERM should end each worker cleanly after its rollout: {codes}"
    assert pool.reloads == {0: 2, 1: 2}, f"each worker loads version 0 at start, then version 1 once: {pool.reloads}"


@pytest.mark.parametrize(
    "problem, config, error, message",
    [
        ("unknown env", {"env": "NoSuchEnv-v9"}, None, "NoSuchEnv"),
        pytest.param(  # the launch command's test of the same refusal stays in `make test`
            "mismatched policy",
            {"env": "Pendulum-v1"},
            "WeightMismatchError",
            "do not have the store's keys",
            marks=pytest.mark.full,
        ),
        ("unimportable policy", {"policy": "no_such_module:make"}, "ModuleNotFoundError", "no_such_module"),
    ],
)
def test_a_worker_that_cannot_start_fails_the_pool_fast(store_factory, problem, config, error, message):
    store = store_factory(mlp_policy(make_env("CartPole-v1")))
    config = {"store": store.name, **config}
    start = time.monotonic()
    with launch(config.pop("store"), 1, **config) as pool, pytest.raises(Exception) as info:
        next(pool.batches())
    took = time.monotonic() - start
    if error is not None:
        assert type(info.value).__name__ == error, f"{problem}: got {info.value!r}"
    assert message in str(info.value), f"{problem}: {info.value}"
    assert any("in the worker process" in note for note in getattr(info.value, "__notes__", [])), problem
    assert took < START_S, f"{problem}: the pool took {took:.0f}s to say so"


def test_a_missing_store_is_named_before_any_worker_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(segment, "SHM_DIR", str(tmp_path))  # no store at all: the hint says to wait

    def no_workers(*args, **kwargs):
        raise AssertionError("the pool started its workers before it looked")

    monkeypatch.setattr(torch.multiprocessing, "get_context", no_workers)  # the context the pool starts them from
    with pytest.raises(StoreNotFoundError, match="no store named 'no-such-store'.*trainer has not created it yet"):
        launch("no-such-store", 2)


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--store", "no-such-store"], 3, "launch: StoreNotFoundError: no store named 'no-such-store'"),
        (["--env", "Pendulum-v1"], 4, "launch: WeightMismatchError: "),
    ],
    ids=["missing store", "mismatched policy"],
)
def test_the_launch_command_fails_in_one_line_with_its_exit_code(store_factory, args, code, message):
    store = store_factory(mlp_policy(make_env("CartPole-v1")))
    command = python("-m", "shmsync.workers.launch", "--store", store.name, "--batches", "1", *args)
    proc = run_command(command, timeout=120)
    assert proc.returncode == code, proc.stderr[-2000:]
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize(
    "queued", [pytest.param(False, id="running"), pytest.param(True, id="with-batches-queued", marks=pytest.mark.full)]
)
def test_a_worker_that_dies_mid_run_is_reported_at_once(store_factory, queued):
    store = store_factory(mlp_policy(make_env("CartPole-v1")))
    with launch(store.name, 2, frames_per_batch=50) as pool:
        batches = pool.batches()
        next(batches)
        if queued:
            # The queue fills while nobody reads it: the dead worker's batches, whose shared
            # tensors only it could hand over, are then still waiting in it.
            wait_for(pool.queue.full, timeout=60, what="the queue to fill")
        os.kill(pool.pids[1], signal.SIGKILL)
        # Worker 0 still produces batches: a pool that missed the death would hand all of them out.
        with pytest.raises(RuntimeError, match=r"worker 1 \(pid \d+\) died with signal SIGKILL"):
            for _ in range(10_000):
                next(batches)


def test_workers_exit_when_their_parent_dies(start):
    parent = start(pool_parent, daemon=False)  # it starts processes of its own
    name, pids = parent.expect("running", timeout=120)
    os.kill(parent.pid, signal.SIGKILL)
    parent.proc.join(10)
    gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=3)
    assert not alive, f"workers outlived their parent: {[p.pid for p in alive]}"
    # The dead trainer's store is garbage now: gc removes it.
    out = cli("gc", name, "--json").stdout
    assert name in out
    assert name not in segment.list_names()


def test_launcher_command_line(store_factory):
    policy = mlp_policy(make_env("CartPole-v1"))
    store = store_factory(policy)
    args = ["--store", store.name, "--num-workers", "2", "--frames-per-batch", "50", "--batches", "4"]
    proc = run_command(python("-m", "shmsync.workers.launch", *args), timeout=150)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("frames, versions [0]") == 4
    assert "exit codes {0: 0, 1: 0}" in proc.stdout
    wait_for(lambda: len(store.readers()) == 0, timeout=10, what="the workers' rows to be free")


def test_launch_errors(store_factory):
    with pytest.raises(ValueError, match="num_workers"):
        launch("x", 0)
    with pytest.raises(ValueError, match="got 1 devices for 2 workers"):
        launch("x", 2, devices=["cpu"])


def test_installed_workers_live_under_shmsync(tmp_path):
    # Run outside the repository: only what is installed is importable there.
    code = (
        "import importlib.util, shmsync.workers.launch as launch; "
        "print(importlib.util.find_spec('workers'), launch.WorkerPool.__name__)"
    )
    proc = run_command(python("-c", code), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["None", "WorkerPool"], "a bare `workers` package is on the import path"
