"""shmsync across hosts: a relay's time from publish to visible on another host, against a raw
gloo send of the same bytes, and the bytes sent per publish per host.

The other host is simulated on this machine: a process with a store directory of its own,
linked over loopback. Prints a table; ``--quick`` for fewer repetitions.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict

SIZES = {"1MB": 1 << 20, "16MB": 16 << 20}


def weights(nbytes: int, value: float = 0.0) -> TensorDict:
    return TensorDict({"w": torch.full((nbytes // 4,), value)})


def _host(host_dir: str, port: int, conn) -> None:
    """The other host: a relay, and a watcher noting when each version becomes visible there."""
    import threading

    from shmsync import StoreNotFoundError, WeightStore, _segment
    from shmsync.relay import Relay

    _segment.SHM_DIR = host_dir
    relay = Relay("127.0.0.1", port, store="bench")
    runner = threading.Thread(target=relay.run, daemon=True)
    runner.start()
    while True:
        try:
            store = WeightStore.attach("bench")
            break
        except StoreNotFoundError:
            time.sleep(0.001)
    seen: dict[int, int] = {}
    last = store.version
    conn.send(("ready", last))
    while runner.is_alive():
        v = store.version
        if v != last:
            seen[v] = time.monotonic_ns()
            last = v
        time.sleep(50e-6)  # a spinning watcher would hold the GIL from the relay's thread
    conn.send(("seen", seen))
    store.close()
    relay.close()


def _raw_receiver(port: int, nbytes: int, reps: int, conn) -> None:
    tcp = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=60))
    pg = _pair(tcp, 1)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    done = []
    for _ in range(reps):
        pg.recv([buf], 0, 0).wait()
        done.append(time.monotonic_ns())
    conn.send(done)


def _pair(tcp, rank: int):
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=60)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.PrefixStore("raw/", tcp), rank, 2, opts)


def free_port() -> int:
    return free_ports(1)


def free_ports(n: int) -> int:
    """A port p with p .. p+n-1 free."""
    import socket

    for _ in range(100):
        with socket.socket() as s:
            s.bind(("", 0))
            base = s.getsockname()[1]
        try:
            for p in range(base, min(base + n, 65536)):
                with socket.socket() as t:
                    t.bind(("", p))
            if base + n <= 65536:
                return base
        except OSError:
            continue
    raise RuntimeError("no free block of ports")


def bench_relay(nbytes: int, reps: int) -> dict:
    from shmsync import WeightStore
    from shmsync.relay import RelaySender

    ctx = mp.get_context("spawn")
    source = weights(nbytes)
    store = WeightStore.create(source)
    port = free_port()
    host_dir = tempfile.mkdtemp(prefix="shmsync-host-")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_host, args=(host_dir, port, child))
    try:
        with RelaySender(store, "127.0.0.1", port) as sender:
            proc.start()
            assert parent.poll(60) and parent.recv()[0] == "ready"
            started = {}
            for i in range(1, reps + 1):
                source["w"].fill_(i)
                started[store.version + 1] = time.monotonic_ns()
                store.publish(source)
                deadline = time.monotonic() + 30
                while sender.relays.get(1, -1) < store.version and time.monotonic() < deadline:
                    time.sleep(0.0002)  # one version in flight at a time: latency, not throughput
                time.sleep(0.002)
            sent = sender.bytes_sent.get(1, 0)
            per_relay_versions = reps + 1  # version 0 on joining, then each publish
        _, seen = parent.recv()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        store.close()
    latency = [(seen[v] - t) / 1e9 for v, t in started.items() if v in seen]
    return {"bytes": nbytes, "visible": latency, "bytes_per_publish": sent / per_relay_versions}


def bench_raw(nbytes: int, reps: int) -> list[float]:
    ctx = mp.get_context("spawn")
    port = free_port()
    tcp = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_raw_receiver, args=(port, nbytes, reps, child))
    proc.start()
    pg = _pair(tcp, 0)
    buf = torch.ones(nbytes, dtype=torch.uint8)
    began = []
    for _ in range(reps):
        began.append(time.monotonic_ns())
        pg.send([buf], 1, 0).wait()
        time.sleep(0.005)  # let the receiver note its time before the next
    done = parent.recv()
    proc.join(30)
    return [(d - b) / 1e9 for b, d in zip(began, done)]


def bench_copy(nbytes: int, reps: int) -> list[float]:
    """One plain copy of the payload (the relay copies it twice: into the trainer's store, out of it)."""
    a, b = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    out = []
    for _ in range(reps):
        a.add_(1)  # as after an optimizer step: the source was just written
        t = time.perf_counter()
        b.copy_(a)
        out.append(time.perf_counter() - t)
    return out


def _distributed_row(kind: str, nbytes: int, batches: int, conn) -> None:
    import sync_bench
    from torchrl.collectors import MultiSyncCollector
    from torchrl.collectors.distributed import DistributedSyncCollector

    from shmsync import ShmWeightSyncScheme

    local = {"weight_sync_schemes": {"policy": ShmWeightSyncScheme()}} if kind == "shmsync" else {}
    collector = DistributedSyncCollector(
        [sync_bench.make_env] * 2,
        sync_bench.make_policy(nbytes),
        frames_per_batch=256,
        total_frames=256 * (batches + 3),
        collector_class=MultiSyncCollector,
        num_workers_per_collector=2,
        collector_kwargs=local,
        launcher="mp",
        tcp_port=str(free_ports(3)),
    )
    cycles, frames, tagged = [], 0, 0
    try:
        t = time.perf_counter()
        for i, batch in enumerate(collector):
            now = time.perf_counter()
            if i >= 3:
                cycles.append(now - t)
                frames += batch.numel()
                tagged += int("policy_version" in batch.keys())
            t = now
    finally:
        collector.shutdown()
    row = {"local": kind, "bytes": nbytes, "fps": frames / sum(cycles), "cycle_p50": statistics.median(cycles)}
    row["batches_with_versions"] = tagged / max(len(cycles), 1)
    conn.send(row)


def bench_distributed(nbytes: int, batches: int) -> list[dict]:
    """TorchRL's DistributedSyncCollector, 2 nodes of 2 workers, pushing the weights before
    every batch: each node's local leg with TorchRL's default scheme against shmsync's (each in
    a fresh process, as a training script would be)."""
    ctx = mp.get_context("spawn")
    out = []
    for kind in ("TorchRL default", "shmsync"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_distributed_row, args=(kind, nbytes, batches, child), daemon=False)
        proc.start()
        if not parent.poll(600):
            proc.kill()
            raise RuntimeError(f"the distributed run with {kind} did not finish")
        out.append(parent.recv())
        proc.join(60)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/hosts_bench.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    reps = 15 if args.quick else 60
    rows, report = [], []
    for label, nbytes in SIZES.items():
        relay = bench_relay(nbytes, reps)
        raw = bench_raw(nbytes, reps)
        copy = bench_copy(nbytes, reps)
        vis, floor, one_copy = (statistics.median(x) for x in (relay["visible"], raw, copy))
        report.append({"payload": label, **relay, "raw_gloo": raw, "copy": copy})
        with_copies = floor + 2 * one_copy
        rows.append(
            f"| {label} | {vis * 1e3:.2f} ms | {floor * 1e3:.2f} ms | {vis / floor:.2f}x | "
            f"{with_copies * 1e3:.2f} ms | {vis / with_copies:.2f}x | "
            f"{relay['bytes_per_publish']:.0f} B ({relay['bytes_per_publish'] - nbytes:.0f} B over the payload) |"
        )
    print("## Another host (loopback): publish() to visible in that host's store, p50")
    print(
        "| payload | shmsync relay | raw gloo send of the same bytes | ratio | raw send + 2 copies | ratio "
        "| sent per publish per host |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    dist_rows = bench_distributed(1 << 20, 10 if args.quick else 40)
    print("\n## DistributedSyncCollector, 2 nodes x 2 workers, Pendulum, 1 MB policy, a push before every batch")
    print("| each node's local scheme | frames/s | trainer's cycle p50 | batches carrying the trainer's version |")
    print("|---|---|---|---|")
    for r in dist_rows:
        share = 100 * r["batches_with_versions"]
        print(f"| {r['local']} | {r['fps']:.0f} | {r['cycle_p50'] * 1e3:.1f} ms | {share:.0f}% |")
    report.append({"distributed": dist_rows})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RL_WARNINGS", "False")
    raise SystemExit(main())
