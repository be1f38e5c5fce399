"""The relay command (shmsync.workers.relay, workers/relay.py): it follows the trainer until it
closes, starts a host's workers behind it, and ends every error in one line with its exit code."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest

from shmsync.relay import RelaySender, wire
from tests.commands import python, run_command, start_command
from tests.relay import peers
from tests.relay.fakes import FakeTrainer, admit, description, send_version
from tests.relay.peers import SECRET, SIZES
from tests.waiting import START_S, wait_for
from tests.weights import blob_weights

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(120)]


@pytest.mark.timeout(START_S + 120)
def test_the_relay_command_follows_the_trainer_until_it_closes(store_factory, host):
    weights = blob_weights(SIZES, 3.0)
    store = store_factory(weights)
    store.publish(weights, version=3)
    env = {**os.environ, "SHMSYNC_DIR": host}
    env["SHMSYNC_RELAY_SECRET"] = SECRET
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        connect = f"127.0.0.1:{sender.port}"
        proc = start_command(_relay("--connect", connect, "--store", "policy"), env=env, stderr=subprocess.PIPE)
        try:
            linked = lambda: sender.relays.get(1) == 3  # noqa: E731
            wait_for(linked, START_S, "the relay command to link", alive=lambda: proc.poll() is None)
        except BaseException:
            proc.kill()
            raise
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "closed its sender after 1 versions" in err


@pytest.mark.torchrl
@pytest.mark.timeout(START_S + 180)
def test_workers_launched_with_a_relay_run_the_trainers_versions_and_stop_with_it(store_factory, start, host):
    from torchrl.envs import GymEnv

    from shmsync.workers.policies import mlp_policy

    policy = mlp_policy(GymEnv("CartPole-v1"))
    store = store_factory(policy)
    store.publish(policy, version=5)
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        workers = start(peers.host_with_workers, host, sender.port, "policy", daemon=False)
        (versions,) = workers.expect("batch", timeout=START_S)  # its relay and worker: two fresh interpreters
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


def _relay(*args):
    """The relay command's command line."""
    return python("-m", "shmsync.workers.relay", *args)


def _command(port, host, *extra):
    env = {**os.environ, "SHMSYNC_DIR": host, "SHMSYNC_RELAY_SECRET": SECRET}
    return run_command(_relay("--connect", f"127.0.0.1:{port}", "--store", "policy", "--timeout", "3", *extra), env=env)


@pytest.mark.parametrize(
    "hostile, code, match",
    [
        ("a version inside a version", 6, r"ProtocolError: .*sent a b'VERS' message where only"),
        ("a layout of 2**61 bytes", 6, r"past 1099511627776"),
        ("the largest version", 6, r"sent version 9223372036854775807"),
        ("a frame altered on the way", 5, r"AuthenticationError: .*failed its check"),
    ],
)
def test_the_relay_command_ends_each_protocol_error_with_its_code_and_one_line(host, hostile, code, match):
    layout, nbytes = description()

    def script(link, attempt):
        if hostile == "a layout of 2**61 bytes":
            doc = json.loads(layout)
            doc["entries"][-1][1], doc["entries"][-1][4] = [1 << 59], 1 << 61
            link.send(b"LYOT", json.dumps(doc).encode())
        elif hostile == "a frame altered on the way":
            link.sock.sendall(wire.FRAME.pack(b"LYOT", len(layout)) + layout + b"\0" * 16)
        else:
            admit(link, layout)
            if hostile == "the largest version":
                send_version(link, (1 << 63) - 1, nbytes, [b"x" * nbytes])
            else:
                send_version(link, 1, nbytes, [b"x" * 4096])
                send_version(link, 2, nbytes, [])
        link.sock.recv(1)

    fake = FakeTrainer(script)
    try:
        proc = _command(fake.port, host)
    finally:
        fake.close()
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, proc.stderr
    assert "Traceback" not in proc.stderr and len([x for x in lines if x.startswith("relay:")]) == 1, proc.stderr
    assert re.search(match, lines[-1]), lines[-1]
    assert os.listdir(host) == []


def test_the_relay_command_never_takes_a_secret_on_its_command_line(host):
    proc = _command(1, host, "--secret", "a secret typed where everyone sees it")
    assert proc.returncode == 2 and "a secret typed" not in proc.stderr + proc.stdout
    assert "--secret-file" in proc.stderr
    short = run_command(
        _relay("--connect", "127.0.0.1:1", "--store", "policy"),
        env={**os.environ, "SHMSYNC_RELAY_SECRET": "passwordpassword"},
    )
    assert short.returncode == 2 and "32 to 4096 random bytes" in short.stderr
    assert "passwordpassword" not in short.stderr


def test_the_relay_command_without_a_secret_says_how_to_give_one():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHMSYNC_RELAY_SECRET")}
    proc = run_command(_relay("--connect", "127.0.0.1:1", "--store", "policy"), env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert "--secret-file FILE" in line and "$SHMSYNC_RELAY_SECRET" in line and "secret=" not in line


@pytest.mark.parametrize("command", ["relay", "launch"])
def test_each_commands_help_describes_it_in_whole_sentences(command):
    proc = run_command(python("-m", f"shmsync.workers.{command}", "--help"))
    description = " ".join(proc.stdout.split("\n\n")[1].split())  # after the usage lines
    assert proc.returncode == 0 and description.endswith(".") and ":mod:" not in description, description
