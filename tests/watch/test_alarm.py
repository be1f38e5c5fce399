"""The stale-reader alarm: readers in real processes that fall behind, freeze, wait for work,
recover or die, and what the alarm says of each."""

import gc
import logging
import os
import signal
import threading
import time

import pytest
from torch import nn

from shmsync import ShmWeightSyncScheme, StaleReaderError, WeightReader
from shmsync.watch import alarm as alarm_module
from shmsync.watch.alarm import ReaderAlarm
from tests.torchrl.collectors import make_env, make_policy
from tests.waiting import STUCK_S, wait_for

pytestmark = pytest.mark.timeout(120)


def reader_that_polls(store, every: float, waiting: bool, conn) -> None:
    """Load the store every ``every`` seconds (never, if 0) until told to stop; with ``waiting``,
    say it waits for work between rollouts. On a message, poll once and say which version."""
    reader = WeightReader(store, nn.Linear(8, 4), worker=1)
    reader.poll()
    reader.set_waiting(waiting)
    conn.send(("ready", reader.version))
    while True:
        if conn.poll(every or None):
            conn.recv()
            reader.poll()
            conn.send(("loaded", reader.version))
        elif every:
            reader.poll()


def _events(alarm, times):
    return [(e.kind, e.row.worker) for t in times for e in alarm.check(now=t)]


@pytest.mark.slow
def test_a_reader_that_keeps_polling_is_never_named(store_factory, start):
    policy = nn.Linear(8, 4)
    store = store_factory(policy)
    child = start(reader_that_polls, store, 0.02, False)
    child.expect("ready")
    alarm = ReaderAlarm(store.readers, stale_after=2.0, on_stale=pytest.fail)
    began = time.monotonic()
    while time.monotonic() - began < 4.0:
        store.publish(policy)
        alarm.check()
        time.sleep(0.01)


@pytest.mark.slow
def test_a_waiting_reader_is_named_only_once_its_process_is_stopped(store_factory, start):
    policy = nn.Linear(8, 4)
    store = store_factory(policy)
    child = start(reader_that_polls, store, 0, True)
    child.expect("ready")
    store.publish(policy)
    alarm = ReaderAlarm(store.readers, stale_after=0.5, on_stale=lambda e: None)
    assert _events(alarm, [0.0, 1.0, 2.0, 3.0]) == [], "a reader waiting for work was named"
    os.kill(child.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: store.readers(processes=True)[0].stopped, what="the reader to be stopped")
        events = alarm.check(now=4.0) + alarm.check(now=4.5)
        assert [(e.kind, e.row.pid) for e in events] == [("stale", child.pid)]
        assert "is 1 version behind (loaded 0, newest 1)" in events[0].message
        assert "its process is stopped" in events[0].message
        assert alarm.check(now=5.0) == [], "a stale reader is named once"
    finally:
        os.kill(child.pid, signal.SIGCONT)
    child.conn.send("poll")
    assert child.expect("loaded") == (1,)
    (event,) = alarm.check(now=6.0)
    assert event.kind == "recovered" and "recovered: loaded version 1" in event.message


@pytest.mark.slow
def test_a_reader_far_behind_is_named_by_max_lag_and_a_dead_one_as_gone(store_factory, start):
    policy = nn.Linear(8, 4)
    store = store_factory(policy)
    child = start(reader_that_polls, store, 0, False)
    child.expect("ready")
    alarm = ReaderAlarm(store.readers, stale_after=None, max_lag=3, on_stale=lambda e: None)
    store.publish(policy)
    store.publish(policy)
    assert _events(alarm, [0.0, 100.0]) == [], "2 versions behind is within max_lag=3"
    store.publish(policy)
    assert _events(alarm, [101.0, 102.0]) == [("stale", 1)]
    child.proc.kill()
    child.proc.join(10)
    assert _events(alarm, [103.0]) == [("gone", 1)]


def test_warnings_are_logged_once_by_the_alarm_thread(store_factory, caplog):
    policy = nn.Linear(8, 4)
    store = store_factory(policy)
    reader = WeightReader(store, nn.Linear(8, 4), worker=5)
    reader.poll()
    store.publish(policy)
    with caplog.at_level(logging.WARNING, logger="shmsync.watch.alarm"):
        alarm = ReaderAlarm(store.readers, stale_after=0.3).start()
        try:
            wait_for(lambda: "worker 5 (pid" in caplog.text, timeout=10, what="the alarm's warning")
            reader.poll()
            wait_for(lambda: "recovered" in caplog.text, timeout=10, what="the recovery to be logged")
        finally:
            alarm.stop()
    assert caplog.text.count("is 1 version behind") == 1


def test_on_stale_raise_stops_the_next_publish_and_publishes_nothing():
    scheme = ShmWeightSyncScheme(stale_after=0.5, on_stale="raise")
    scheme.init_on_sender(model=nn.Linear(8, 4), devices=["cpu"], model_id="policy")
    try:
        store = scheme.store
        reader = WeightReader(store, nn.Linear(8, 4), worker=0)
        reader.poll()
        scheme.send()
        alarm = scheme.alarm
        alarm.stop()  # checked by hand below
        alarm.check(now=0.0), alarm.check(now=1.0), alarm.check(now=1.5)
        with pytest.raises(StaleReaderError, match="worker 0 .* is 1 version behind") as raised:
            scheme.send()
        assert raised.value.event.row.pid == os.getpid()
        assert store.version == 1, "the publish that raised wrote nothing"
        scheme.send()
        assert store.version == 2, "the error is raised once"
    finally:
        scheme.shutdown()


def test_a_scheme_collected_on_the_alarm_thread_while_it_holds_its_lock_stops_its_alarm():
    """Garbage collection runs finalizers on whichever thread allocates, the alarm thread inside
    its lock included: a scheme collected there shuts down (stopping its alarm) without waiting
    for a lock its own thread holds."""
    scheme = ShmWeightSyncScheme(stale_after=30)
    scheme.init_on_sender(model=nn.Linear(8, 4), devices=["cpu"], model_id="policy")
    alarm, store = scheme.alarm, scheme.store
    assert alarm is not None and not alarm.stopped
    scheme.cycle = scheme  # only the cyclic collector frees it, wherever it next runs
    del scheme
    ticker, finished = alarm_module._ticker(), threading.Event()

    def collect_holding_the_lock() -> None:
        with ticker.lock:  # as the alarm thread does while it lists the alarms
            gc.collect()
        finished.set()

    threading.Thread(target=collect_holding_the_lock, daemon=True).start()
    try:
        assert finished.wait(10), "the collected scheme's shutdown waited for the alarm thread's lock"
        assert alarm.stopped and store.closed
        wait_for(lambda: alarm not in set(ticker.alarms), timeout=10, what="the alarm thread to drop the alarm")
    finally:
        store.close()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stale_after": 0}, "stale_after"),
        ({"stale_after": "30"}, "stale_after"),
        ({"max_lag": 0}, "max_lag"),
        ({"max_lag": 1.5}, "max_lag"),
        ({"on_stale": "ignore"}, "on_stale"),
    ],
)
def test_alarm_settings_out_of_range_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ShmWeightSyncScheme(**kwargs)
    with pytest.raises(ValueError, match=match):
        ReaderAlarm(list, **kwargs)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_frozen_async_worker_is_named_within_t_and_again_when_it_recovers(caplog):
    """The trainer keeps publishing while a worker is stopped. It does not iterate meanwhile:
    TorchRL's queue would wait forever for a batch the stopped worker is in the middle of
    handing over (its tensors' descriptors come from the worker itself) - which is when an
    operator most needs the alarm, and it still fires, on its own thread."""
    from torchrl.collectors import MultiAsyncCollector

    stale_after = 2.0
    policy = make_policy()
    scheme = ShmWeightSyncScheme(stale_after=stale_after)
    collector = MultiAsyncCollector(
        [make_env] * 3, policy, frames_per_batch=20, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    try:
        it = iter(collector)
        for _ in range(3):
            next(it)
        workers = {row.worker: row.pid for row in scheme.readers()}
        assert sorted(workers) == [0, 1, 2], f"every worker is in the table: {scheme.readers()}"
        victim = workers[1]
        with caplog.at_level(logging.WARNING, logger="shmsync.watch.alarm"):
            os.kill(victim, signal.SIGSTOP)
            try:
                stopped_at = time.monotonic()
                ages = []
                while f"(pid {victim} on" not in caplog.text:
                    assert time.monotonic() - stopped_at < STUCK_S, "the frozen worker was not named"
                    collector.update_policy_weights_()
                    ages.append(next(r for r in scheme.readers() if r.pid == victim).since_reload_s)
                    time.sleep(0.05)
                assert "worker 1 (pid" in caplog.text and "its process is stopped" in caplog.text
                row = next(r for r in scheme.readers(processes=True) if r.pid == victim)
                assert row.behind >= 1 and row.stopped and ages[-1] > ages[0], "the table shows it behind, ageing"
            finally:
                os.kill(victim, signal.SIGCONT)
            began = time.monotonic()
            while "recovered" not in caplog.text:
                assert time.monotonic() - began < STUCK_S, "the worker's recovery was not logged"
                next(it)  # batches queued while the trainer only published: older versions
                collector.update_policy_weights_()
        assert caplog.text.count(f"(pid {victim} on") == 2, caplog.text
        for _ in range(6):  # once the queue has turned over, every worker runs the newest weights
            lag = scheme.version - next(it)["policy_version"]
            collector.update_policy_weights_()
        assert int(lag.min()) <= 2, "a worker's frames fell behind"
    finally:
        collector.shutdown()
