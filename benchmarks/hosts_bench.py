"""shmsync across hosts: a relay tree's time from publish() to visible on each host, and the
trainer's bytes sent per publish, against raw sends of the same bytes measured in the same run;
the encrypted link against the plain one and against its floor (the plain link plus the
cipher's own time on the same bytes, timed in the same run).

    python benchmarks/hosts_bench.py            # full run (a few minutes on 2 cores)
    python benchmarks/hosts_bench.py --quick    # fewer repetitions and hosts
    python benchmarks/hosts_bench.py --docs     # also write the tables into docs/results/
    python benchmarks/hosts_bench.py --fan-out  # the tree's shapes, plain and encrypted (~15 min)
    python benchmarks/hosts_bench.py --frozen   # a frozen backbone: what changed against the whole version (~3 min)

Hosts are simulated on this machine: each is a process with a store folder of its own, its
relay linked over loopback. All of them share this machine's cores, so the last of H hosts
cannot be faster than the cores can move H copies: the floor for it is H raw gloo sends of the
payload between H pairs of processes, started together, until the last completes. The first
host is set against one raw send. Compare the ratios, not the times.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from tensordict import TensorDict

# The code this benchmark's results measure (benchmarks/provenance.py).
MEASURES = [
    "benchmarks/hosts_bench.py",
    "shmsync/relay",
    "shmsync/writer",
    "shmsync/reader",
    "shmsync/store",
    "shmsync/core",
]

SIZES = {"1MB": 1 << 20, "16MB": 16 << 20}
SECRET = "the hosts benchmark's relay secret, 32 bytes or more"
BUCKET = 1 << 20


def weights(nbytes: int, value: float = 0.0) -> TensorDict:
    return TensorDict({"w": torch.full((nbytes // 4,), value)})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- a simulated host: its relay, and the time each version becomes visible there ------------------
def _host(host_dir: str, port: int, index: int, seen, reps: int, encrypt: bool, conn) -> None:
    import threading

    torch.set_num_threads(1)
    from shmsync.core import segment
    from shmsync.relay import Relay

    segment.SHM_DIR = host_dir
    relay = Relay("127.0.0.1", port, store="bench", secret=SECRET, timeout=60, encrypt=encrypt)
    costs: dict[int, tuple[int, bool]] = {}  # version -> its bytes on this host's link, and whether a delta
    count = relay.note_received

    def note_received(got) -> None:  # what the relay counts of each version, kept per version
        count(got)
        costs[got.version] = (got.wire_bytes, got.delta)

    relay.note_received = note_received  # type: ignore[method-assign]
    runner = threading.Thread(target=relay.run, daemon=True)
    runner.start()
    while relay.store is None:
        time.sleep(0.001)

    def visible(version: int) -> None:
        if 0 < version <= reps:
            seen[index * (reps + 1) + version] = time.monotonic_ns()

    relay.store.add_listener(visible)  # runs as the version commits: no polling
    conn.send(("ready", relay.parent, relay.serving))
    runner.join()
    conn.send(("costs", costs))
    relay.close()


WARMUP = 4  # versions published first, not timed: every slot and buffer has its pages by then


def bench_tree(nbytes: int, hosts: int, fanout: int, reps: int, encrypt: bool = True) -> dict:
    """publish() to visible on every host of a tree, and the trainer's bytes sent per publish,
    over ``reps`` versions after :data:`WARMUP` untimed ones (a training run publishes thousands:
    the first versions' page faults are not what it sees)."""
    from shmsync import WeightStore
    from shmsync.relay import RelaySender

    ctx = mp.get_context("spawn")
    timed, reps = reps, reps + WARMUP
    seen = ctx.Array("q", hosts * (reps + 1), lock=False)
    source = weights(nbytes)
    store = WeightStore.create(source, num_slots=max(3, fanout + 2))
    procs, dirs = [], [tempfile.mkdtemp(prefix="shmsync-host-") for _ in range(hosts)]
    try:
        with RelaySender(store, "127.0.0.1", 0, secret=SECRET, fanout=fanout, encrypt=encrypt) as sender:
            for i, host_dir in enumerate(dirs):  # one after the other: the tree's shape is known
                parent, child = ctx.Pipe()
                args = (host_dir, sender.port, i, seen, reps, encrypt, child)
                proc = ctx.Process(target=_host, args=args, daemon=True)
                proc.start()
                procs.append((proc, parent))
                if not parent.poll(120):
                    raise RuntimeError(f"host {i}'s relay did not start")
                parent.recv()
            time.sleep(0.2)
            started, publish = {}, []
            for v in range(1, reps + 1):
                if v == WARMUP + 1:
                    sent_before, started, publish = sum(sender.bytes_sent.values()), {}, []
                source["w"].fill_(v)
                started[v] = time.monotonic_ns()
                store.publish(source, version=v)
                publish.append((time.monotonic_ns() - started[v]) / 1e9)
                deadline = time.monotonic() + 60
                while any(seen[h * (reps + 1) + v] == 0 for h in range(hosts)):  # one version at a time
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"version {v} did not reach every host")
                    time.sleep(0.0002)
                time.sleep(0.003)
            sent = sum(sender.bytes_sent.values()) - sent_before
    finally:
        for proc, _ in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        store.close()
        for host_dir in dirs:  # each simulated host's folder, once its relay is gone
            shutil.rmtree(host_dir, ignore_errors=True)
    times = [[(seen[h * (reps + 1) + v] - started[v]) / 1e9 for v in started] for h in range(hosts)]
    per_version = list(zip(*times))
    return {
        "bytes": nbytes,
        "hosts": hosts,
        "fanout": fanout,
        "first": [min(t) for t in per_version],
        "last": [max(t) for t in per_version],
        "bytes_per_publish": sent / timed,
        "publish": publish,
    }


# -- a frozen backbone: what changed, against the whole version and raw sends of the changed bytes -----
FROZEN_BYTES, TRAINED_BYTES = 64 << 20, 2 << 20


def bench_frozen(hosts: int, reps: int, deltas: bool) -> dict:
    """A 64 MB frozen backbone and a 2 MB head the trainer changes at every version, relayed to
    ``hosts`` hosts (the default tree), each version sent as its delta (``deltas``) or whole:
    publish() to visible on the last host, and the bytes each host's link took per version."""
    from shmsync import WeightStore
    from shmsync.relay import RelaySender

    ctx = mp.get_context("spawn")
    timed, reps = reps, reps + WARMUP
    seen = ctx.Array("q", hosts * (reps + 1), lock=False)
    source = TensorDict({"backbone": torch.randn(FROZEN_BYTES // 4), "head": torch.zeros(TRAINED_BYTES // 4)})
    store = WeightStore.create(source, num_slots=4)
    procs, dirs = [], [tempfile.mkdtemp(prefix="shmsync-host-") for _ in range(hosts)]
    try:
        with RelaySender(store, "127.0.0.1", 0, secret=SECRET, deltas=deltas) as sender:
            for i, host_dir in enumerate(dirs):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_host, args=(host_dir, sender.port, i, seen, reps, True, child), daemon=True)
                proc.start()
                procs.append((proc, parent))
                if not parent.poll(120):
                    raise RuntimeError(f"host {i}'s relay did not start")
                parent.recv()
            time.sleep(0.2)
            started, publish = {}, []
            for v in range(1, reps + 1):
                if v == WARMUP + 1:
                    sent_before, started, publish = sum(sender.bytes_sent.values()), {}, []
                source["head"].fill_(v)  # the head trains; the backbone stays
                started[v] = time.monotonic_ns()
                store.publish(source, version=v)
                publish.append((time.monotonic_ns() - started[v]) / 1e9)
                deadline = time.monotonic() + 60
                while any(seen[h * (reps + 1) + v] == 0 for h in range(hosts)):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"version {v} did not reach every host")
                    time.sleep(0.0002)
                time.sleep(0.003)
            sent = sum(sender.bytes_sent.values()) - sent_before
            fanout = sender.fanout
        costs = []
        for _, parent in procs:
            if not parent.poll(60):
                raise RuntimeError("a host did not report what its versions cost")
            _, host_costs = parent.recv()
            costs += [host_costs[v] for v in started if v in host_costs]
    finally:
        for proc, _ in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        store.close()
        for host_dir in dirs:  # each simulated host's folder, once its relay is gone
            shutil.rmtree(host_dir, ignore_errors=True)
    last = [max((seen[h * (reps + 1) + v] - started[v]) / 1e9 for h in range(hosts)) for v in started]
    return {
        "hosts": hosts,
        "deltas": deltas,
        "fanout": fanout,
        "last": last,
        "publish": publish,
        "egress_per_publish": sent / timed,
        "host_bytes": [b for b, _ in costs],
        "sent_as_delta": sum(d for _, d in costs) / max(len(costs), 1),
    }


def frozen_main(args: argparse.Namespace) -> int:
    """The frozen backbone, deltas against whole versions and raw TCP sends of the changed bytes,
    alternate rounds, one table."""
    started = time.perf_counter()
    machine = {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    reps, rounds = (6, 1) if args.quick else (12, 2)
    p50 = statistics.median
    rows, report = [], []
    for hosts in [int(h) for h in args.frozen_hosts.split(",")]:
        print(f"frozen backbone: {hosts} hosts ...", file=sys.stderr, flush=True)
        runs: dict[str, list] = {"delta": [], "whole": [], "one send": [], "H sends": []}
        for _ in range(rounds):
            runs["delta"].append(bench_frozen(hosts, reps, True))
            runs["whole"].append(bench_frozen(hosts, reps, False))
            runs["one send"] += bench_raw("tcp", TRAINED_BYTES, 1, reps)
            runs["H sends"] += bench_raw("tcp", TRAINED_BYTES, hosts, reps)
        one, many = p50(runs["one send"]), p50(runs["H sends"])
        for kind in ("delta", "whole"):
            x = {k: [v for run in runs[kind] for v in run[k]] for k in ("last", "publish", "host_bytes")}
            egress = statistics.mean(run["egress_per_publish"] for run in runs[kind])
            as_delta = statistics.mean(run["sent_as_delta"] for run in runs[kind])
            last, per_host = p50(x["last"]), p50(x["host_bytes"])
            shape = "chain" if runs[kind][0]["fanout"] == 1 else f"fan-out {runs[kind][0]['fanout']}"
            rows.append(
                [str(hosts), shape, kind, f"{100 * as_delta:.0f}%", f"{per_host / 1e6:.2f} MB"]
                + [f"{per_host / TRAINED_BYTES:.3f}x", f"{egress / 1e6:.2f} MB", ms(p50(x["publish"]))]
                + [ms(last), ms(many), f"{last / many:.2f}x"]
            )
        report.append({"hosts": hosts, "runs": runs, "one_send": one})
    text = f"# shmsync hosts benchmark, frozen backbone: {machine['cores']} cores, Python {machine['python']}, "
    text += f"torch {machine['torch']}\n\n" + table(
        "A 64 MB frozen backbone and a 2 MB head that changes at every version, relayed to H hosts (p50)",
        ["H", "tree", "sent as", "deltas", "bytes / host / version", "/ changed bytes", "trainer egress"]
        + ["publish()", "last host", "H raw sends", "last / H raw"],
        rows,
        "delta: what shmsync sends (a host holding the version before gets the leaves that changed); whole:\n"
        "the same tree sending every version whole (RelaySender(deltas=False)). deltas: the timed versions\n"
        "that reached the hosts as deltas. bytes / host / version: what one version took on a host's link,\n"
        "frames and tags included, over the 2 MB that changed. last host: publish() to visible on the last\n"
        "host. H raw sends: H raw TCP sends of the 2 MB that changed, between H pairs of processes, started\n"
        "together, until the last completes (the floor: every host gets the changed bytes once). Encrypted\n"
        "links; the hosts share this machine's cores. Runs alternate, samples pooled.",
    )
    print(text)
    if args.docs:
        from sync_bench import write_docs_page

        page = Path(__file__).resolve().parents[1] / "docs/results/hosts_frozen.md"
        write_docs_page(page, text, MEASURES)
    out = Path(args.out).with_name("hosts_frozen.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "rows": report, "seconds": time.perf_counter() - started}))
    print(f"\nJSON written to {out} ({time.perf_counter() - started:.0f}s)", file=sys.stderr)
    return 0


def pooled(runs: list[dict]) -> dict:
    """Several :func:`bench_tree` runs of one configuration as one: their samples together."""
    out = dict(runs[0])
    for key in ("first", "last", "publish"):
        out[key] = [x for run in runs for x in run[key]]
    out["bytes_per_publish"] = statistics.mean(run["bytes_per_publish"] for run in runs)
    return out


# -- the cipher's own time: seal and open a payload, piece by piece, as a link does ----------------
def bench_cipher(nbytes: int, reps: int) -> list[float]:
    """Seconds to encrypt and then decrypt ``nbytes`` in pieces of :data:`BUCKET` (AES-256-GCM, into
    buffers made once), ``reps`` times: what the two ends of an encrypted link add to a plain one."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead = AESGCM(os.urandom(32))
    data = memoryview(torch.ones(nbytes, dtype=torch.uint8).numpy())
    pieces = [(off, min(BUCKET, nbytes - off)) for off in range(0, nbytes, BUCKET)]
    sealed = [bytearray(n + 16) for _, n in pieces]
    back = memoryview(bytearray(nbytes))
    times = []
    for rep in range(reps):
        began = time.perf_counter()
        for i, (off, n) in enumerate(pieces):
            aead.encrypt_into((rep * len(pieces) + i).to_bytes(12, "big"), data[off : off + n], b"aad", sealed[i])
        for i, (off, n) in enumerate(pieces):
            aead.decrypt_into((rep * len(pieces) + i).to_bytes(12, "big"), sealed[i], b"aad", back[off : off + n])
        times.append(time.perf_counter() - began)
    return times


# -- the floors: raw sends of the same bytes between pairs of processes ------------------------------
def _raw_peer(kind: str, rank: int, port: int, pair: int, nbytes: int, reps: int, go, done, conn) -> None:
    torch.set_num_threads(1)
    buf = torch.ones(nbytes, dtype=torch.uint8)
    if kind == "gloo":
        tcp = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=120))
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=120)
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"pair-{pair}/", tcp), rank, 2, opts)

        def send() -> None:
            pg.send([buf], 1, 0).wait()

        def recv() -> None:
            pg.recv([buf], 0, 0).wait()
    else:  # a plain TCP socket: the relay's own transport
        if rank == 0:
            server = socket.create_server(("127.0.0.1", 0))
            conn.send(server.getsockname()[1])
            sock, _ = server.accept()
        else:
            sock = socket.create_connection(("127.0.0.1", conn.recv()))
        view = memoryview(buf.numpy())

        def send() -> None:
            sock.sendall(view)

        def recv() -> None:
            got = 0
            while got < nbytes:
                got += sock.recv_into(view[got:])

    conn.send("ready")
    for r in range(reps):
        go[r].wait()
        if rank == 0:
            send()
        else:
            recv()
            done[pair * reps + r] = time.monotonic_ns()


def bench_raw(kind: str, nbytes: int, pairs: int, reps: int) -> list[float]:
    """``pairs`` raw sends of ``nbytes`` started together, until the last completes, ``reps`` times
    after :data:`WARMUP` untimed ones (as the trees)."""
    return _bench_raw(kind, nbytes, pairs, reps + WARMUP)[WARMUP:]


def _bench_raw(kind: str, nbytes: int, pairs: int, reps: int) -> list[float]:
    ctx = mp.get_context("spawn")
    port = free_port()
    tcp = None
    if kind == "gloo":
        tcp = dist.TCPStore("127.0.0.1", port, None, True, timeout=timedelta(seconds=120), wait_for_workers=False)
    go = [ctx.Event() for _ in range(reps)]
    done = ctx.Array("q", pairs * reps, lock=False)
    procs, conns = [], []
    for pair in range(pairs):
        ends = []
        for rank in (0, 1):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_raw_peer, args=(kind, rank, port, pair, nbytes, reps, go, done, child), daemon=True
            )
            proc.start()
            procs.append(proc)
            ends.append(parent)
        if kind == "tcp":
            ends[1].send(ends[0].recv())  # the receiver connects where the sender listens
        conns += ends
    try:
        for c in conns:
            if not c.poll(120) or c.recv() != "ready":
                raise RuntimeError("a raw peer did not start")
        time.sleep(0.2)
        out = []
        for r in range(reps):
            began = time.monotonic_ns()
            go[r].set()
            deadline = time.monotonic() + 60
            while any(done[p * reps + r] == 0 for p in range(pairs)):
                if time.monotonic() > deadline:
                    raise RuntimeError("a raw send did not complete")
                time.sleep(0.0002)
            out.append((max(done[p * reps + r] for p in range(pairs)) - began) / 1e9)
            time.sleep(0.003)
        return out
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        del tcp


# -- the tree's shape: plain and encrypted trees against raw TCP sends, alternate rounds -------------
FAN_OUT_SIZES = {"1MB": 1 << 20, "16MB": 16 << 20, "128MB": 128 << 20}
FAN_OUT_REPS = {"1MB": 20, "16MB": 10, "128MB": 4}


def bench_fan_out(sizes: list[str], host_counts: list[int], rounds: int) -> list[dict]:
    """For each payload and H: one raw TCP send, H raw TCP sends started together, the plain tree
    and the encrypted tree of the default shape, and the encrypted tree of the other shape, in
    ``rounds`` alternate rounds (samples pooled)."""
    from shmsync.relay.messages import BUCKET_BYTES, choose_fanout

    out = []
    for label in sizes:
        nbytes, reps = FAN_OUT_SIZES[label], FAN_OUT_REPS[label]
        chosen = choose_fanout(nbytes, BUCKET_BYTES)
        other = 2 if chosen == 1 else 1
        for hosts in host_counts:
            print(f"fan-out: {label}, {hosts} hosts ...", file=sys.stderr, flush=True)
            runs: dict[str, list] = {"one send": [], "H sends": [], "plain": [], "encrypted": [], "other shape": []}
            for _ in range(rounds):
                runs["one send"] += bench_raw("tcp", nbytes, 1, reps)
                runs["H sends"] += bench_raw("tcp", nbytes, hosts, reps)
                runs["plain"].append(bench_tree(nbytes, hosts, chosen, reps, encrypt=False))
                runs["encrypted"].append(bench_tree(nbytes, hosts, chosen, reps))
                runs["other shape"].append(bench_tree(nbytes, hosts, other, reps))
            row = {"payload": label, "hosts": hosts, "chosen": chosen, "other": other}
            row.update({k: pooled(v) if isinstance(v[0], dict) else v for k, v in runs.items()})
            out.append(row)
    return out


def fan_out_table(rows: list[dict]) -> str:
    p50 = statistics.median
    shape = {1: "chain", 2: "fan-out 2"}
    lines = []
    for r in rows:
        one, many = p50(r["one send"]), p50(r["H sends"])
        for key, fanout in (("plain", r["chosen"]), ("encrypted", r["chosen"]), ("other shape", r["other"])):
            x = r[key]
            first, last = p50(x["first"]), p50(x["last"])
            lines.append(
                [r["payload"], str(r["hosts"]), "plain" if key == "plain" else "encrypted", shape[fanout]]
                + [f"{x['bytes_per_publish'] / x['bytes']:.2f}x", ms(first), f"{first / one:.2f}x"]
                + [ms(last), f"{last / many:.2f}x", ms(one), ms(many)]
            )
    return table(
        "The tree's shape: publish() to visible on the first and the last of H hosts (p50), against raw TCP sends",
        ["payload", "H", "links", "shape", "egress", "first", "first / 1 send", "last", "last / H sends"]
        + ["1 send", "H sends"],
        lines,
        "egress: the trainer's bytes sent per publish over the payload. 1 send: one raw TCP send of the\n"
        "payload between two processes; H sends: H such sends started together, until the last completes\n"
        "(what the cores can move). The first shape of each H is the default (choose_fanout); the last row\n"
        "is the other shape, encrypted. Rounds alternate: each round runs every column once.",
    )


# -- TorchRL's distributed collector with shmsync as each node's local scheme ---------------------------
def _distributed_row(kind: str, nbytes: int, batches: int, conn) -> None:
    import sync_bench
    import torchrl.collectors.distributed as torchrl_distributed
    from torchrl.collectors import MultiSyncCollector

    import shmsync.torchrl.distributed
    from shmsync import ShmWeightSyncScheme

    local = {"weight_sync_schemes": {"policy": ShmWeightSyncScheme()}} if kind == "shmsync" else {}
    # TorchRL's own class with its default local scheme; shmsync's subclass with shmsync's.
    cls = shmsync.torchrl.distributed if kind == "shmsync" else torchrl_distributed
    collector = cls.DistributedSyncCollector(
        [sync_bench.make_env] * 2,
        sync_bench.make_policy(nbytes),
        frames_per_batch=256,
        total_frames=256 * (batches + 3),
        collector_class=MultiSyncCollector,
        num_workers_per_collector=2,
        collector_kwargs=local,
        launcher="mp",
        tcp_port=str(_free_block(3)),
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


def _free_block(n: int) -> int:
    """A port p with p .. p+n-1 free (the distributed collectors use tcp_port, +1 and +2)."""
    for _ in range(100):
        base = free_port()
        try:
            for p in range(base, base + n):
                with socket.socket() as t:
                    t.bind(("", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free block of ports")


def bench_distributed(nbytes: int, batches: int) -> list[dict]:
    """DistributedSyncCollector, 2 nodes of 2 workers, pushing before every batch: each node's
    local scheme with TorchRL's default scheme, then shmsync's (each in a fresh process)."""
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


# -- the report ----------------------------------------------------------------------------------
def ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms"


def table(title: str, head: list[str], rows: list[list[str]], note: str = "") -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"## {title}", "  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines) + (f"\n{note}" if note else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and hosts")
    parser.add_argument("--out", default="benchmarks/results/hosts_bench.json")
    parser.add_argument("--docs", action="store_true", help="also write the tables into docs/results/hosts_bench.md")
    parser.add_argument("--no-distributed", action="store_true", help="leave TorchRL's distributed collector out")
    parser.add_argument(
        "--fan-out", action="store_true", help="only the tree's shape: plain and encrypted against raw TCP sends"
    )
    parser.add_argument(
        "--frozen", action="store_true", help="only a frozen backbone: deltas against whole versions and raw sends"
    )
    parser.add_argument("--frozen-hosts", default="2,4", help="host counts of --frozen")
    parser.add_argument("--rounds", type=int, default=2, help="alternate rounds of --fan-out")
    parser.add_argument("--sizes", default="1MB,16MB,128MB", help="payloads of --fan-out")
    parser.add_argument("--hosts", default="2,4,8", help="host counts of --fan-out")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.fan_out:
        return fan_out_main(args)
    if args.frozen:
        return frozen_main(args)
    reps = {"1MB": 12 if args.quick else 40, "16MB": 6 if args.quick else 20}
    host_counts = [2, 4] if args.quick else [2, 4, 8]
    started = time.perf_counter()
    machine = {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    report: dict = {"machine": machine}
    p50 = statistics.median
    # Encrypted and plain links are timed in alternate runs, pooled: a drift of the machine during
    # the run (the 1 MB link's median moves by a tenth of a millisecond) falls on both alike.
    rounds = 1 if args.quick else 3
    one_host, trees, protection = [], [], []
    for label, nbytes in SIZES.items():
        n = reps[label]
        print(f"{label}: one host ...", file=sys.stderr, flush=True)
        encrypted_runs, plain_runs = [], []
        for _ in range(rounds):
            encrypted_runs.append(bench_tree(nbytes, 1, 2, n))
            plain_runs.append(bench_tree(nbytes, 1, 2, n, encrypt=False))
        relay, plain = pooled(encrypted_runs), pooled(plain_runs)
        gloo, tcp = bench_raw("gloo", nbytes, 1, n), bench_raw("tcp", nbytes, 1, n)
        cipher = bench_cipher(nbytes, n)
        one_host.append({"payload": label, "relay": relay, "raw_gloo": gloo, "raw_tcp": tcp})
        protection.append({"payload": label, "hosts": 1, "protected": relay, "plain": plain, "cipher": cipher})
        last = max(host_counts)
        print(f"{label}: {last} hosts, plain and encrypted frames ...", file=sys.stderr, flush=True)
        encrypted_runs, plain_runs = [], []
        for _ in range(rounds - 1):  # the last encrypted run is the tree of fan-out 2 below
            encrypted_runs.append(bench_tree(nbytes, last, 2, n))
            plain_runs.append(bench_tree(nbytes, last, 2, n, encrypt=False))
        plain_runs.append(bench_tree(nbytes, last, 2, n, encrypt=False))
        for hosts in host_counts:
            print(f"{label}: {hosts} hosts ...", file=sys.stderr, flush=True)
            floor = bench_raw("gloo", nbytes, hosts, n)
            tree = bench_tree(nbytes, hosts, 2, n)
            star = bench_tree(nbytes, hosts, hosts, n)
            trees.append({"payload": label, "hosts": hosts, "tree": tree, "star": star, "floor": floor})
            if hosts == last:
                encrypted_runs.append(tree)
        protection.append(
            {
                "payload": label,
                "hosts": last,
                "protected": pooled(encrypted_runs),
                "plain": pooled(plain_runs),
                "cipher": cipher,
            }
        )
    report["one_host"], report["trees"], report["protection"] = one_host, trees, protection

    rows = []
    for r in one_host:
        vis, gloo, tcp = p50(r["relay"]["first"]), p50(r["raw_gloo"]), p50(r["raw_tcp"])
        copy = p50(r["relay"]["publish"])
        rows.append(
            [r["payload"], ms(vis), ms(gloo), f"{vis / gloo:.2f}x", ms(tcp), f"{vis / tcp:.2f}x", ms(copy)]
            + [f"{vis / (copy + tcp):.2f}x"]
        )
    parts = [
        f"# shmsync hosts benchmark: {machine['cores']} cores, Python {machine['python']}, torch {machine['torch']}",
        table(
            "Another host: publish() to visible in its store (p50), against one raw send of the same bytes",
            ["payload", "relay", "raw gloo send", "relay / gloo", "raw TCP send", "relay / TCP", "publish()"]
            + ["relay / (publish + TCP)"],
            rows,
            "publish() to visible includes publish's own copy into the trainer's store (publish(): that\n"
            "call alone, p50); the relay then sends from that slot as it lies and receives straight into a\n"
            "free slot of the other host's store. publish + TCP: the copy and the raw send one after the other.",
        ),
    ]
    rows = []
    for r in trees:
        floor, first_floor = p50(r["floor"]), p50(next(o["raw_gloo"] for o in one_host if o["payload"] == r["payload"]))
        for shape in ("tree", "star"):
            x = r[shape]
            nbytes = x["bytes"]
            first, last = p50(x["first"]), p50(x["last"])
            rows.append(
                [
                    r["payload"],
                    str(r["hosts"]),
                    "fanout 2" if shape == "tree" else "one link per host",
                    f"{x['bytes_per_publish'] / nbytes:.2f}x",
                    ms(first),
                    f"{first / first_floor:.2f}x",
                    ms(last),
                    ms(floor),
                    f"{last / floor:.2f}x",
                ]
            )
    parts.append(
        table(
            "H hosts: the trainer's egress and publish() to visible on the first and the last host (p50)",
            ["payload", "H", "relays", "sent / payload", "first", "first / 1 send", "last", "H sends", "last / H"],
            rows,
            "sent / payload: the trainer's bytes sent per publish over the payload. H sends: H raw gloo sends of\n"
            "the payload between H pairs of processes, started together, until the last completes (what the\n"
            "cores can move); 1 send: one raw gloo send, for the first host.",
        )
    )
    rows = []
    cores = machine["cores"] or 1
    for r in protection:
        h, key = r["hosts"], "first" if r["hosts"] == 1 else "last"
        protected, plain, cipher = p50(r["protected"][key]), p50(r["plain"][key]), p50(r["cipher"])
        # The trainer seals the payload once and each of the H hosts opens it once (half the
        # cipher's time each); the cores share that work.
        floor = plain + cipher / 2 * (h + 1) / min(cores, h + 1)
        rows.append(
            [r["payload"], str(h), ms(plain), ms(protected), f"{protected / plain:.2f}x", ms(cipher)]
            + [ms(floor), f"{protected / floor:.2f}x"]
        )
    parts.append(
        table(
            "Encrypted links (AES-256-GCM) against plain frames: publish() to visible on the last host (p50)",
            ["payload", "H", "plain", "encrypted", "encrypted / plain", "cipher", "floor", "encrypted / floor"],
            rows,
            "plain and encrypted: the samples of alternate runs of each, pooled (three of each in a full\n"
            "run). cipher: sealing and opening the payload once, in the link's pieces, on one core (timed\n"
            "here, in this run). floor: the plain link plus one seal (the trainer's) and H opens (one a\n"
            "host), shared by the cores. Hosts here share this machine's cores with the trainer, so the cipher\n"
            "competes with the copies; between real hosts each relay has cores of its own, and the wire,\n"
            "not the cipher, is the limit.",
        )
    )
    if not args.no_distributed:
        print("distributed collector ...", file=sys.stderr, flush=True)
        dist_rows = bench_distributed(1 << 20, 10 if args.quick else 40)
        report["distributed"] = dist_rows
        parts.append(
            table(
                "DistributedSyncCollector, 2 nodes x 2 workers, Pendulum, 1 MB policy, a push before every batch",
                ["each node's local scheme", "frames/s", "trainer's cycle p50", "batches with the trainer's version"],
                [
                    [r["local"], f"{r['fps']:.0f}", ms(r["cycle_p50"]), f"{100 * r['batches_with_versions']:.0f}%"]
                    for r in dist_rows
                ],
            )
        )
    report["seconds"] = time.perf_counter() - started
    text = "\n\n".join(parts)
    print(text)
    if args.docs:
        from sync_bench import write_docs_page

        write_docs_page(Path(__file__).resolve().parents[1] / "docs/results/hosts_bench.md", text, MEASURES)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(f"\nJSON written to {out} ({report['seconds']:.0f}s)", file=sys.stderr)
    return 0


def fan_out_main(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    machine = {"cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}
    hosts = [int(h) for h in args.hosts.split(",")]
    rows = bench_fan_out(args.sizes.split(","), hosts, args.rounds)
    out = Path(args.out).with_name("hosts_fan_out.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine, "rows": rows, "seconds": time.perf_counter() - started}))
    cores, python, version = machine["cores"], machine["python"], machine["torch"]
    head = f"# shmsync relay tree shapes: {cores} cores, Python {python}, torch {version}, {args.rounds} rounds"
    text = head + "\n\n" + fan_out_table(rows)
    print(text)
    if args.docs:
        from sync_bench import write_docs_page

        page = Path(__file__).resolve().parents[1] / "docs/results/hosts_fan_out.md"
        write_docs_page(page, text, MEASURES)
    print(f"\nJSON written to {out} ({time.perf_counter() - started:.0f}s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RL_WARNINGS", "False")
    raise SystemExit(main())
