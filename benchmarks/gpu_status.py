"""The README's GPU line, for the run of ``benchmarks/gpu_check.sh`` that just ended (it calls this).

Prints the bullet to paste over the one that starts with "- GPU:" in README.md's Limits: the date,
the commit checked, the GPU, the torch release and how many CUDA tests passed. Without arguments it
reads them from this machine (torch, ``git``); each can be given instead (``--gpu``, ``--torch``,
``--commit``, ``--date``), which is how ``tests/benchmarks/test_benchmarks.py`` checks that the line
it prints is the one ``tests/docs/test_facts.py`` reads. A check that failed prints no line to paste.

    python benchmarks/gpu_status.py --passed 6
"""

from __future__ import annotations

import argparse
import datetime
import re
import subprocess
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torch_floor() -> str:
    """The oldest torch shmsync admits (pyproject.toml's ``torch>=X.Y``)."""
    return re.search(r'"torch>=([\d.]+)', (ROOT / "pyproject.toml").read_text()).group(1)


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:2])


def line(date: str, commit: str, gpu: str, torch_version: str, passed: int, floor: str) -> str:
    """The README bullet for a run of ``date`` at ``commit`` on ``gpu`` with ``torch_version``."""
    below = f" (below the torch {floor} shmsync now requires)" if _numbers(torch_version) < _numbers(floor) else ""
    text = (
        "- GPU: the CUDA paths are checked on a GPU by hand, not on every run (CI has no GPU); `bash "
        "benchmarks/gpu_check.sh` checks them in under 8 minutes and prints this line. Last run: "
        f"{date}, at commit {commit}, on an {gpu} with torch {torch_version}{below}: {passed} CUDA tests passed."
    )
    return textwrap.fill(text, width=99, subsequent_indent="  ", break_on_hyphens=False)


def _this_commit() -> str:
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return run.stdout.strip() if run.returncode == 0 else "(not a git checkout)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--passed", type=int, required=True, help="CUDA tests that passed")
    parser.add_argument("--failed", action="store_true", help="the check failed: print no line to paste")
    parser.add_argument("--gpu", help="default: torch's name of GPU 0")
    parser.add_argument("--torch", help="default: the installed torch's version")
    parser.add_argument("--commit", help="default: git's HEAD")
    parser.add_argument("--date", help="default: today")
    args = parser.parse_args()
    if args.failed:
        print("gpu_check.sh failed (see above): nothing to paste into the README")
        return
    if args.gpu is None or args.torch is None:
        import torch

        args.gpu = args.gpu or torch.cuda.get_device_name(0)
        args.torch = args.torch or torch.__version__
    date = args.date or datetime.date.today().isoformat()
    print("Paste this over the README's bullet that starts with '- GPU:' (its Limits):\n")
    print(line(date, args.commit or _this_commit(), args.gpu, args.torch, args.passed, torch_floor()))


if __name__ == "__main__":
    main()
