"""Hosts' readers in the trainer's table (shmsync/relay/reports.py): each relay reports its host's
readers, a lost host is marked, and a report that fails its check is cut and listed nowhere."""

from __future__ import annotations

import json
import os

import pytest

from shmsync.relay import RelaySender
from tests.commands import cli
from tests.relay import peers
from tests.relay.peers import SECRET, SIZES, admitted, join_as_relay
from tests.waiting import STUCK_S, wait_for
from tests.weights import blob_weights, set_all

pytestmark = [pytest.mark.slow, pytest.mark.distributed, pytest.mark.timeout(120)]


def test_the_trainers_table_lists_every_hosts_readers_and_marks_a_lost_host(store_factory, start, host, tmp_path):
    weights = blob_weights(SIZES, 0.0)
    store = store_factory(weights, name=f"relayed-{os.getpid()}")
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        relay = start(peers.run_relay, host, sender.port, "policy", None, None)
        relay.expect("started")
        reader = start(peers.follow_as_worker, host, "policy", SIZES, 4)
        (pid,) = reader.expect("attached")
        for version in (1, 2, 3):
            set_all(weights, version)
            store.publish(weights)
            wait_for(
                lambda: (
                    [(r.pid, r.worker, r.version) for r in store.readers() if r.report_age_s is not None]
                    == [(pid, 4, store.version)]
                ),
                timeout=STUCK_S,
                what=f"the remote reader at version {store.version} in the trainer's table",
            )
        table = store.readers()
        (remote,) = [r for r in table if r.report_age_s is not None]
        assert remote.store == "policy" and remote.state in ("sleeping", "running") and remote.behind == 0
        assert [(h.via, h.state, h.readers) for h in table.hosts] == [("relay 1", "reporting", 1)]

        # Another process on the trainer's host sees them too, once the report file is next
        # rewritten (at most once a second, so it may trail the trainer's own table by a report).
        def remote_in_cli() -> list:
            doc = json.loads(cli("ls", store.name, "--json").stdout)
            return [(r["pid"], r["worker"], r["version"]) for r in doc["readers"] if r["report_age_s"] is not None]

        wait_for(lambda: remote_in_cli() == [(pid, 4, 3)], timeout=10, what="the remote reader at 3 in `shmsync ls`")
        relay.proc.kill()
        relay.proc.join(10)
        wait_for(lambda: store.readers().gone, timeout=STUCK_S, what="the lost host's rows to be marked")
        table = store.readers()
        assert [(r.pid, r.state) for r in table.gone] == [(pid, "lost")] and not table.rows
        assert [h.state for h in table.hosts] == ["lost"] and "no report from" in table.summary()
    assert not os.path.exists(f"/dev/shm/shmsync-{store.name}~hosts"), "the report file outlived the sender"


@pytest.mark.parametrize(
    "report",
    [
        b"not json",
        json.dumps({"hosts": [["h", "0123456789abcdef", "policy", -1.0, []]]}).encode(),
        json.dumps(
            {"hosts": [["h", "0123456789abcdef", "policy", 0.0, [[0, 0, 0, 0, 0, 0, False, "", None]]]]}
        ).encode(),
        json.dumps({"hosts": [["h", "0123456789abcdef", "policy", 0.0, [], [3, -1, True, 1, 0, 9]]]}).encode(),
        json.dumps({"hosts": [["h", "0123456789abcdef", "policy", 0.0, [], [3, 9, "delta", 1, 0, 9]]]}).encode(),
    ],
)
def test_a_relay_whose_report_fails_its_check_is_cut_and_listed_nowhere(store_factory, report):
    store = store_factory(blob_weights(SIZES, 1.0))
    with RelaySender(store, "127.0.0.1", 0, secret=SECRET) as sender:
        link, _ = join_as_relay(sender.port)
        admitted(link, 0)
        wait_for(lambda: 1 in sender.relays, what="the link to be admitted")
        link.send(b"RPRT", report)
        link.sock.settimeout(10)
        while link.sock.recv(65536):
            pass  # until the sender hangs up
        assert not [r for r in store.readers() if r.report_age_s is not None] and not store.readers().hosts
