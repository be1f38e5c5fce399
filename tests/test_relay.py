"""The relay: a trainer's versions published on other hosts, each host a process with its own
store directory, linked over torch.distributed (gloo) on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_crash import _cli

from shmsync.relay import RelaySender

import relay_procs
from procs import blob_weights, set_all
from relay_procs import SECRET

pytestmark = pytest.mark.timeout(120)

SIZES = {"a": 300_000, "b": 1_000, "c": 7}  # ~1.2 MB: several 256 KB buckets


def wait_for(condition, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def start_relay(start, host, port, precreate=None):
    """A relay process for ``host``, once it is about to join."""
    relay = start(relay_procs.run_relay, host, port, "policy", None, precreate)
    relay.expect("started")
    return relay


@pytest.fixture
def host(tmp_path):
    """Another host's shared memory: a directory of its own."""
    path = tmp_path / "host-b"
    path.mkdir()
    return str(path)


def test_a_relay_publishes_the_trainers_versions_on_its_host(store_factory, start, host):
    weights = blob_weights(SIZES, 0.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, bucket_bytes=256 << 10) as sender:
        relay = start_relay(start, host, sender.port)
        reader = start(relay_procs.follow, host, "policy", SIZES, 20)
        (first,) = reader.expect("attached")
        assert first == 0  # the trainer's version when the relay joined
        for version in list(range(1, 11)) + [20]:  # versions may skip: the trainer's numbers
            set_all(weights, version)
            store.publish(weights, version=version)
            time.sleep(0.02)
        (seen,) = reader.expect("seen")
        wait_for(lambda: max(sender.relays.values(), default=-1) == 20, what="the relay to be sent version 20")
    received, host_version = relay.expect("done")
    assert host_version == 20
    assert seen[-1][0] == 20
    for version, values in seen:
        assert values == [float(version)], f"version {version} on the other host held {values}"
    assert [v for v, _ in seen] == sorted({v for v, _ in seen}), "versions went back"
    assert 1 <= received <= 12  # version 0, then at most one per publish


def test_a_host_that_joins_late_starts_at_the_trainers_current_version(store_factory, start, host):
    weights = blob_weights(SIZES, 7.0)
    store = store_factory(weights)
    store.publish(weights, version=7)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        relay = start_relay(start, host, sender.port)
        reader = start(relay_procs.follow, host, "policy", SIZES, 7)
        (first,) = reader.expect("attached")
        (seen,) = reader.expect("seen")
    assert first == 7 and seen == [(7, [7.0])], "the host's first version must be the trainer's current one"
    assert relay.expect("done") == (1, 7)


def test_a_relay_whose_host_store_holds_another_model_writes_nothing(store_factory, start, host):
    store = store_factory(blob_weights(SIZES, 1.0))
    other = {"a": 300_000, "b": 999, "c": 7}
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        relay = start_relay(start, host, sender.port, other)
        kind, message, version, values = relay.expect("error", timeout=60)
        wait_for(lambda: sender.dropped, what="the sender to drop the relay")
    assert kind == "WeightMismatchError"
    assert "'b' has shape (999,) here, (1000,) on the trainer" in message
    assert version == 0 and values == [5.0], "the host's store changed"


def test_relays_exit_soon_after_the_trainer_dies(start, host):
    trainer = start(relay_procs.trainer, SIZES)
    name, port = trainer.expect("ready")
    relay = start_relay(start, host, port)
    trainer.expect("linked", timeout=60)
    killed = time.monotonic()
    os.kill(trainer.pid, signal.SIGKILL)
    kind, message, *_ = relay.expect("error", timeout=30)
    assert kind == "TrainerGoneError", message
    assert time.monotonic() - killed < 10
    relay.proc.join(10)
    assert not relay.proc.is_alive()
    assert not os.listdir(host), "the relay's store outlived it"
    # The dead trainer's own store is left to `shmsync gc`, as on one host.
    assert [r["name"] for r in json.loads(_cli("gc", name, "--json"))["removed"]] == [name]


def test_a_relay_killed_mid_receive_leaves_its_host_whole_and_a_new_relay_catches_up(store_factory, start, host):
    big = {"a": 6_000_000, "b": 7}  # 24 MB: a version takes a while to cross
    weights = blob_weights(big, 0.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, bucket_bytes=1 << 20) as sender:
        first = start_relay(start, host, sender.port)
        wait_for(lambda: sender.relays.get(1, -1) >= 0, what="the first relay to link")
        version = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:  # publish flat out: the relay is always receiving
            version += 1
            set_all(weights, version)
            store.publish(weights)
        os.kill(first.pid, signal.SIGKILL)  # most likely mid-receive
        first.proc.join(10)
        # Its host keeps a whole version: a reader there loads one complete version.
        reader = start(relay_procs.follow, host, "policy", big, 0)
        (held,) = reader.expect("attached")
        ((loaded, values),) = reader.expect("seen")[0]
        assert loaded == held and values == [float(held)], f"version {held} on the host held {values}"
        # A new relay takes the writer role over and catches up to the newest version.
        second = start_relay(start, host, sender.port)
        for _ in range(3):
            version += 1
            set_all(weights, version)
            store.publish(weights)
        wait_for(lambda: sender.relays.get(2, -1) == version, what="the new relay to catch up")
        assert 1 in sender.dropped, "the killed relay's link was not dropped"
    received, host_version = second.expect("done")
    assert host_version == version


def test_a_stalled_host_slows_neither_the_trainer_nor_the_other_hosts(store_factory, start, tmp_path):
    hosts = [tmp_path / "host-b", tmp_path / "host-c"]
    for path in hosts:
        path.mkdir()
    weights = blob_weights(SIZES, 0.0)
    store = store_factory(weights)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET, bucket_bytes=256 << 10) as sender:
        relays = [start_relay(start, str(h), sender.port) for h in hosts]
        wait_for(lambda: len(sender.relays) == 2 and min(sender.relays.values()) >= 0, what="both relays to link")
        stalled = relays[1]
        os.kill(stalled.pid, signal.SIGSTOP)  # host C stops receiving, mid-version or between
        try:
            slowest = 0.0
            for version in range(1, 41):
                set_all(weights, version)
                began = time.perf_counter()
                store.publish(weights)
                slowest = max(slowest, time.perf_counter() - began)
                time.sleep(0.005)
            wait_for(lambda: max(sender.relays.values()) == 40, what="the running host to get version 40")
            assert slowest < 0.25, f"a publish took {slowest:.3f}s while a host was stalled"
            assert min(sender.relays.values()) < 40, "the stalled host kept up: the test stalled nothing"
        finally:
            os.kill(stalled.pid, signal.SIGCONT)
        # Resumed, the stalled host skips to the newest version (latest wins).
        wait_for(lambda: min(sender.relays.values()) == 40, what="the stalled host to catch up")
    (_, version_b), (received_c, version_c) = (relay.expect("done") for relay in relays)
    assert version_b == version_c == 40
    assert received_c < 40, "the stalled host was sent every version instead of the newest"


def test_the_relay_command_follows_the_trainer_until_it_closes(store_factory, host):
    weights = blob_weights(SIZES, 3.0)
    store = store_factory(weights)
    store.publish(weights, version=3)
    env = {**os.environ, "SHMSYNC_DIR": host}
    env["SHMSYNC_RELAY_SECRET"] = SECRET
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        connect = f"127.0.0.1:{sender.port}"
        cmd = [sys.executable, "-m", "shmsync.workers.relay", "--connect", connect, "--store", "policy"]
        proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
        try:
            wait_for(lambda: sender.relays.get(1) == 3, what="the relay command to link")
        except BaseException:
            proc.kill()
            raise
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "closed its sender after 1 versions" in err


def test_workers_launched_with_a_relay_run_the_trainers_versions_and_stop_with_it(store_factory, start, host):
    from torchrl.envs import GymEnv

    from shmsync.workers.policies import mlp_policy

    policy = mlp_policy(GymEnv("CartPole-v1"))
    store = store_factory(policy)
    store.publish(policy, version=5)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        workers = start(relay_procs.host_with_workers, host, sender.port, "policy", daemon=False)
        (versions,) = workers.expect("batch", timeout=90)
        assert versions == [5], "the host's workers must start at the trainer's version"
        store.publish(policy, version=9)
        deadline = time.monotonic() + 60
        while versions != [9] and time.monotonic() < deadline:
            (versions,) = workers.expect("batch")
        assert versions == [9]
    # The trainer closed its sender: the relay ends, and the workers with it, cleanly.
    while True:
        kind, *rest = workers.conn.recv() if workers.conn.poll(60) else ("timeout",)
        if kind != "batch":
            break
    assert kind == "ended", kind
    codes, relay_code = rest
    assert relay_code == 0 and all(code == 0 for code in codes.values()), (codes, relay_code)
    workers.proc.join(10)
    assert not os.listdir(host), "the host's store outlived its relay"
