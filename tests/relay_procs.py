"""Child processes for the relay tests: each "host" is a process with its own store directory."""

from __future__ import annotations

import time

SECRET = "the relay tests' secret, 32 bytes"


def on_host(host_dir: str) -> None:
    """Make this process see ``host_dir`` as its host's shared memory."""
    from shmsync import _segment

    _segment.SHM_DIR = host_dir


def run_relay(host_dir: str, port: int, name: str, max_versions, precreate, conn) -> None:
    """A relay for host ``host_dir``; reports ("done", versions received, store version) or the error."""
    on_host(host_dir)
    from shmsync import WeightStore
    from shmsync.relay import Relay

    from procs import blob_weights

    existing = None
    if precreate is not None:  # this host's store, built here from another model
        existing = WeightStore.create(blob_weights(precreate, 5.0), name=name)
        existing.release_writer()
    relay = Relay("127.0.0.1", port, store=name, secret=SECRET, timeout=30)
    conn.send(("started",))
    try:
        relay.run(max_versions)
        conn.send(("done", relay.received, relay.store.version))
    except Exception as e:
        version = existing.version if existing is not None else None
        values = sorted({float(t.flatten()[0]) for t in existing.snapshot().weights.values()}) if existing else None
        conn.send(("error", type(e).__name__, str(e), version, values))
    finally:
        relay.close()
        if existing is not None:
            existing.close()


def follow(host_dir: str, name: str, sizes, last: int, conn) -> None:
    """A reader on host ``host_dir``: loads every version it sees until ``last``; reports, per
    load, (version, distinct values in the weights)."""
    on_host(host_dir)
    from shmsync import StoreNotFoundError, WeightReader, WeightStore

    from procs import Blob, mixed_values

    deadline = time.monotonic() + 60
    while True:
        try:
            store = WeightStore.attach(name)
            break
        except StoreNotFoundError:
            if time.monotonic() > deadline:
                conn.send(("error", "no store"))
                return
            time.sleep(0.01)
    module = Blob(sizes)
    reader = WeightReader(store, module)
    reader.poll()  # the first load
    seen = [(reader.version, sorted(mixed_values(module)))]
    conn.send(("attached", seen[0][0]))
    while seen[-1][0] < last and time.monotonic() < deadline:
        if reader.poll():
            seen.append((reader.version, sorted(mixed_values(module))))
        else:
            time.sleep(0.001)
    conn.send(("seen", seen))
    reader.close()
    store.close()


def trainer(sizes, conn) -> None:
    """A trainer with a RelaySender, publishing until killed."""
    from shmsync import WeightStore
    from shmsync.relay import RelaySender

    from procs import blob_weights, set_all

    weights = blob_weights(sizes, 0.0)
    store = WeightStore.create(weights)
    sender = RelaySender(store, "127.0.0.1", 0, secret=SECRET)
    conn.send(("ready", store.name, sender.port))
    version = 0
    while True:
        time.sleep(0.01)
        version += 1
        set_all(weights, version)
        store.publish(weights)
        if sender.relays and version % 10 == 0:
            conn.send(("linked", version))
    del sender


def host_with_workers(host_dir: str, port: int, name: str, conn) -> None:
    """A host running `launch(..., relay=...)`: reports each batch's versions, then how it ended."""
    import os

    os.environ["SHMSYNC_DIR"] = host_dir  # for the relay and workers it spawns
    os.environ["SHMSYNC_RELAY_SECRET"] = SECRET
    on_host(host_dir)
    from shmsync.workers.launch import launch

    with launch(name, 1, "CartPole-v1", relay=f"127.0.0.1:{port}", frames_per_batch=50) as pool:
        for _, batch in pool.batches():
            conn.send(("batch", sorted(set(batch["policy_version"].flatten().tolist()))))
        codes = pool.stop()
    conn.send(("ended", codes, pool.relay.exitcode))
