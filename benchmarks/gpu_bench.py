"""GPU benchmark: publishing from a CUDA trainer and reloading into CUDA workers' modules.

    python benchmarks/gpu_bench.py [--sizes 16MB 128MB 1GB]

For each payload: the time the trainer's Python thread spends in publish(), the time until
the version is visible to readers, and the reload time into a CUDA module, each next to a
plain pinned copy_ of the same bytes (device-to-host and host-to-device) in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from shmsync import WeightReader, WeightStore

SIZES = {"16MB": 16 << 20, "128MB": 128 << 20, "1GB": 1 << 30}


class Blob(torch.nn.Module):
    def __init__(self, nbytes: int, device: str) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(nbytes // 4, device=device))


def med(xs):
    return statistics.median(xs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", nargs="*", default=list(SIZES))
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", default="benchmarks/results/gpu_bench.json")
    args = parser.parse_args()
    dev = torch.device("cuda:0")
    rows = []
    for label in args.sizes:
        nbytes = SIZES[label]
        trainer = Blob(nbytes, "cuda")
        store = WeightStore.create(trainer)
        pinned = torch.empty(nbytes // 4, pin_memory=True)
        gpu = torch.empty(nbytes // 4, device=dev)
        d2h, h2d, thread, visible, reload = [], [], [], [], []
        worker = Blob(nbytes, "cuda")
        reader = WeightReader(store, worker)
        reader.poll()
        for _ in range(args.reps + 2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            pinned.copy_(trainer.w.data, non_blocking=True)
            torch.cuda.synchronize()
            d2h.append(time.perf_counter() - t)
            t = time.perf_counter()
            gpu.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()
            h2d.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            t = time.perf_counter()
            store.publish(trainer)
            thread.append(time.perf_counter() - t)
            store.flush()
            visible.append(time.perf_counter() - t)
            t = time.perf_counter()
            reader.poll()
            reload.append(time.perf_counter() - t)
        d2h, h2d, thread, visible, reload = (x[2:] for x in (d2h, h2d, thread, visible, reload))
        row = {
            "payload": label,
            "d2h_pinned_copy_ms": med(d2h) * 1e3,
            "publish_thread_ms": med(thread) * 1e3,
            "publish_thread_over_d2h": med(thread) / med(d2h),
            "visible_ms": med(visible) * 1e3,
            "visible_over_d2h": med(visible) / med(d2h),
            "h2d_pinned_copy_ms": med(h2d) * 1e3,
            "reload_ms": med(reload) * 1e3,
            "reload_over_h2d": med(reload) / med(h2d),
        }
        rows.append(row)
        store.close()
        del trainer, worker, pinned, gpu
        torch.cuda.empty_cache()
    head = list(rows[0])
    print(f"# GPU benchmark on {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(" | ".join(head))
    for r in rows:
        print(" | ".join(f"{v:.3f}" if isinstance(v, float) else str(v) for v in r.values()))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
