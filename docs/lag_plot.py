"""Draws docs/_static/policy-lag.png from a run of the CartPole example logged as CSV.

python examples/train_cartpole.py --async --log-dir runs --target-return 0 --total-frames 6144
pip install matplotlib && python docs/lag_plot.py runs/cartpole
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def series(folder: Path, name: str) -> tuple[list[int], list[float]]:
    rows = [line.split(",") for line in (folder / "scalars" / "policy_lag" / f"{name}.csv").read_text().split()]
    return [int(step) for step, _ in rows], [float(value) for _, value in rows]


def main(run: str, out: str = str(Path(__file__).parent / "_static" / "policy-lag.png")) -> None:
    folder = Path(run)
    fig, (frames, readers) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    for name, style in (("frames_max", "-"), ("frames_mean", "-"), ("frames_min", ":")):
        frames.plot(*series(folder, name), style, label=name.split("_")[1])
    frames.set_ylabel("frames' lag (versions)")
    frames.set_title("Policy lag per batch: MultiAsyncCollector, 2 workers, a publish per batch")
    frames.legend(loc="upper right")
    for name, style in (("readers_max", "-"), ("readers_mean", "-")):
        readers.plot(*series(folder, name), style, label=name.split("_")[1])
    readers.set_ylabel("workers' lag now (versions)")
    readers.set_xlabel("frames collected")
    readers.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(*sys.argv[1:])
