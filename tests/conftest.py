import fcntl
import multiprocessing as mp
import os
import signal

# Ray swaps a node address of 127.0.0.1 for the host's network address, and binds its servers
# there, unless it runs as a single-node cluster: keep every server the tests start on loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray starts its workers at niceness 15: beside other CPU-bound work they get a few percent of a
# core and an actor takes minutes to import torch. The tests want them on equal terms.
os.environ.setdefault("RAY_worker_niceness", "0")

import pytest

from shmsync.core import segment
from shmsync.testing import stores_created_by

# The `full` tier: run by `make test-full` (the interleavings also by `make test-protocol`), not by
# `make test`, which CI runs and which must stay near 15 minutes on 2 cores. Each is a heavier
# variant, or another sampling, of a path that a test in `make test` also runs (named here).
FULL_ONLY = {
    # The larger interleaving configurations (20-130 s each): `make test` explores the smaller
    # ones of each mode and finds every mutation's counterexample but the deepest.
    "tests/test_protocol_interleavings.py::test_every_interleaving_keeps_the_protocols_guarantees": [
        "weak: a zero-copy reader",
        "weak: 2 slots, an optimistic reader",  # its one-publish form stays
        "weak give-backs: a zero-copy reader",
        "sc give-backs: a pinned and a zero-copy reader",  # its one-publish form stays
        "tso crashes: a zero-copy reader",
        "sc crashes: a pinned reader and a stopped one",
        "tso: a pinned and a zero-copy reader",
        "sc: optimistic and zero-copy readers, 3 publishes",
        "sc: a pinned and a zero-copy reader",
        "sc crashes: a zero-copy reader",
        "tso crashes, promises: a waiting and an optimistic reader",  # its one-publish form stays
    ],
    "tests/test_protocol_interleavings.py::test_the_checker_finds_a_counterexample_without": ["no_reader_full_fence"],
    # Stress runs sample the interleavings the checker explores; the crash, stuck-reader and
    # zero-copy lease tests stay.
    "tests/test_store.py::test_torn_read_stress": None,
    "tests/test_zero_copy.py::test_zero_copy_stress": None,
    "tests/test_store.py::test_no_starvation_under_back_to_back_publishing": None,
    "tests/test_store.py::test_two_slow_readers_do_not_take_the_pin_off_each_other": None,
    "tests/test_store.py::test_stuck_or_killed_reader_never_blocks_writer": ["sigkill"],  # sigstop stays
    # More forms of one path (one of each stays).
    "tests/test_torchrl_conformance.py::test_init_on_sender_before_the_collector": [
        "device_map_fn-async",
        "model-sync",
        "params_map-sync",
    ],
    "tests/test_torchrl_conformance.py::test_per_worker_weights_with_distinct_factories": ["per_worker_weights"],
    "tests/test_torchrl_conformance.py::test_hook_setters_keep_the_poll_and_the_tag": ["async"],
    "tests/test_workers.py::test_a_worker_that_dies_mid_run_is_reported_at_once": ["with-batches-queued"],
    "tests/test_workers.py::test_workers_reload_lazily_and_tag_frames": ["Pendulum-v1-True"],
    # The demo's other collector and reload (the scheme's tests cover each; the default run and
    # the demo's --keep-running test stay).
    "tests/test_examples.py::test_train_cartpole_tiny_budget": ["async-private-copy"],
    "tests/test_examples.py::test_train_async_tiny_budget": None,
    "tests/test_examples.py::test_a_ctrl_c_pressed_at_any_point_ends_the_demo_with_its_summary": ["20"],
    "tests/test_ray.py::test_a_push_to_some_actors_only_still_carries_the_trainers_number": None,
    "tests/test_registration.py::test_a_config_driven_trainer_selects_shmsync_by_an_override": None,
    # Trees of relays beyond the one that grows, feeds and loses no version.
    "tests/test_relay.py::test_a_stalled_middle_relay_holds_up_only_the_hosts_below_it": None,
    "tests/test_relay.py::test_a_killed_middle_relay_cuts_off_only_the_hosts_below_which_reattach_and_catch_up": None,
    # A second form of a path another test takes: private copies under MultiSync with 1 worker
    # (MultiAsync's private copies stay); a pool refusing a mismatched policy (the launch
    # command's test of the same refusal stays).
    "tests/test_scheme.py::test_published_weights_reach_every_worker_and_edits_do_not": ["MultiSyncCollector-1-False"],
    "tests/test_workers.py::test_a_worker_that_cannot_start_fails_the_pool_fast": [
        "mismatched policy-config1-WeightMismatchError-do not have the store's keys"
    ],
    # The benchmarks' smoke run (three collectors side by side): run by hand before a table is
    # published, and in `make test-full`.
    "tests/test_benchmarks.py::test_loop_bench_smallest_case": None,
    # The hosts page's cluster blocks: test_distributed.py and test_ray.py run the same remote_schemes.
    "tests/test_docs.py::test_a_block_runs_as_written": [
        "hosts-Each-host-s-local-scheme-under-TorchRL-s-distributed-collectors",
        "hosts-Ray",
    ],
}
# TorchRL releases played in `make test`: one per way the scheme meets TorchRL in a collector's
# workers and trainer (its tracker, its setup in the workers, the hook's state); the rest of the
# catalogue (the rollout, the distributed and Ray collectors' entries, which test_distributed.py
# and test_ray.py run unchanged) in `make test-full`, and on the older minors none (their
# conformance tests run).
PLAYED_IN_CI = {"tracker renamed", "the scheme never set up in the workers", "the hook's interval state renamed"}


# What the older TorchRL minors run in `make test` (marker `minors`): the tests whose outcome
# depends on TorchRL's release, because they go through the boundary's entries or TorchRL's own
# call paths (the hook, the scheme's conformance, the collector names, registration, each way of
# running a collector, what importing changes). The other `torchrl` tests drive shmsync's own
# fallbacks, which do not change with the minor: they run under 0.14, and all under every minor in
# `make test-full`. A value lists the forms that run (None: all of them).
ON_OLDER_MINORS = {  # module: None (all its torchrl tests), or {function: None (all forms) or forms}
    "test_hooks.py": None,
    "test_distributed.py": None,
    "test_registration.py": {"test_from_backend_builds_the_scheme_whichever_is_imported_first": None},
    "test_scheme.py": {"test_the_older_collector_names_tag_frames_with_published_versions": None},
    "test_torchrl_conformance.py": {
        "test_init_on_sender_without_anything_to_build_from_raises": None,
        "test_policy_factory_that_makes_no_module_raises": None,
        "test_track_policy_version_reports_the_loaded_version": None,
        "test_every_worker_holds_the_trainers_weights_after_an_update_in_every_form": None,
        "test_a_single_process_collector_says_the_scheme_has_nothing_to_do": None,
    },
    "test_torchrl_compat.py": {
        "test_an_entry_found_otherwise_names_itself_the_torchrl_and_the_versions_that_work": None,
        "test_every_entry_is_checked_somewhere_and_in_the_docs_catalogue": None,
        "test_importing_shmsync_changes_no_torchrl_attribute": ["every shmsync module and the pytest plugin"],
    },
    "test_ray.py": {
        "test_every_frame_carries_the_trainers_version_and_no_store_is_left": None,
        "test_torchrls_own_ray_collector_with_a_shmsync_local_leg_is_refused_at_once": None,
    },
}


def _on_older_minors(function: str, param: str) -> bool:
    module, _, name = function.removeprefix("tests/").partition("::")
    if module not in ON_OLDER_MINORS:
        return False
    functions = ON_OLDER_MINORS[module]
    if functions is None:
        return True
    if name not in functions:
        return False
    return functions[name] is None or param in functions[name]


# Started first: the longest tests (30-100 s), so that under xdist none of them begins last and
# keeps one worker busy while the others sit idle.
LONGEST_FIRST = ("tests/test_protocol_interleavings.py::", "tests/test_distributed.py::", "tests/test_crash.py::")


def _stale_full_only_keys(items) -> list[str]:
    """The FULL_ONLY keys that name no collected test, in the modules that were collected: a
    renamed test or parameter would otherwise run in `make test` unnoticed."""
    seen: dict[str, set[str]] = {}
    for item in items:
        function, _, param = item.nodeid.partition("[")
        seen.setdefault(function, set()).add(param[:-1])
    modules = {function.partition("::")[0] for function in seen}
    stale = []
    for function, params in FULL_ONLY.items():
        if function.partition("::")[0] not in modules:
            continue
        if function not in seen:
            stale.append(function)
        else:
            stale += [f"{function}[{p}]" for p in params or () if p not in seen[function]]
    return stale


def pytest_collection_modifyitems(config, items):
    from shmsync.torchrl import compat

    newest = compat.NEWEST_RELEASE <= compat.TORCHRL_VERSION  # as test_torchrl_compat's _applies has it
    # Whole modules collected under the TorchRL the keys are written for (older minors may name
    # some parameters otherwise).
    if newest and not any("::" in arg for arg in config.args):
        stale = _stale_full_only_keys(items)
        if stale:
            raise pytest.UsageError("tests/conftest.py's FULL_ONLY names no collected test: " + ", ".join(stale))

    items.sort(key=lambda item: not item.nodeid.startswith(LONGEST_FIRST))  # stable: otherwise as collected
    for item in items:
        function, _, param = item.nodeid.partition("[")
        param = param[:-1]
        if item.get_closest_marker("torchrl") and _on_older_minors(function, param):
            item.add_marker(pytest.mark.minors)
        chosen = FULL_ONLY.get(function, False)
        if function.endswith("::test_a_torchrl_that_changed_ends_loaded_or_with_the_entry_named"):
            chosen = None if not (newest and param in PLAYED_IN_CI) else False
        if chosen is None or (chosen and param in chosen):
            item.add_marker(pytest.mark.full)


@pytest.fixture(autouse=True)
def _no_leaks(shm_leak_check):
    """Every test must leave no store and no child process behind."""
    yield


@pytest.fixture(scope="session", autouse=True)
def _suite_leaves_no_store():
    before = set(segment.list_names())
    yield
    left = stores_created_by({os.getpid()}) - before
    assert not left, f"the suite left stores in {segment.SHM_DIR}: {sorted(left)}"


@pytest.fixture
def one_ray_cluster(tmp_path_factory):
    """Held while a test runs a Ray cluster: one at a time across xdist workers (two clusters
    at once on two cores slow each other several times over)."""
    # The base temp folder's parent is shared by every xdist worker of this run.
    path = tmp_path_factory.getbasetemp().parent / "ray-cluster.lock"
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # the test's timeout bounds the wait
        yield


@pytest.fixture
def ctx():
    return mp.get_context("spawn")


class Child:
    def __init__(self, proc, conn):
        self.proc, self.conn = proc, conn

    @property
    def pid(self):
        return self.proc.pid

    def expect(self, tag, timeout=60.0):
        """The next message, which must start with ``tag``."""
        if not self.conn.poll(timeout):
            raise AssertionError(f"child {self.pid} sent nothing for {timeout}s (alive: {self.proc.is_alive()})")
        msg = self.conn.recv()
        assert msg[0] == tag, msg
        return msg[1:]


@pytest.fixture
def start(ctx):
    """``start(target, *args)`` runs ``target(*args, conn)`` in a spawned child; all are killed after the test."""
    started = []

    def _start(target, *args, daemon=True):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=target, args=(*args, child), daemon=daemon)
        proc.start()
        child.close()
        started.append(proc)
        return Child(proc, parent)

    yield _start
    for proc in started:
        if proc.is_alive():
            try:
                os.kill(proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            proc.kill()
        proc.join(10)


def pytest_terminal_summary(terminalreporter):
    """The state counts the protocol's interleaving checker explored (recorded as "explored")."""
    lines = {
        value
        for reports in terminalreporter.stats.values()
        for report in reports
        for name, value in getattr(report, "user_properties", ())
        if name == "explored"
    }
    if lines:
        terminalreporter.section("protocol interleavings explored")
        for line in sorted(lines):
            terminalreporter.write_line(line)
