"""Running what a user runs: the ``shmsync`` command and the checkout's scripts (examples,
benchmarks), each in an interpreter of its own. ``CHECKOUT`` is the checkout whose files the tests
read (its docs, examples and sources): the folder above this one, or ``SHMSYNC_CHECKOUT`` when the
tests run from a copy against an installed shmsync (``make test``'s shipped legs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# The folder that holds the ``tests`` package: on a child interpreter's path, ``import tests.x`` works.
TESTS_ROOT = Path(__file__).resolve().parents[1]
CHECKOUT = Path(os.environ.get("SHMSYNC_CHECKOUT") or TESTS_ROOT)


def with_tests_importable(env: dict[str, str] | None = None, *first: str) -> dict[str, str]:
    """``env`` (default: this process's) with ``first`` and then :data:`TESTS_ROOT` ahead on
    ``PYTHONPATH``, for a child interpreter that imports the tests' helpers by name."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([*first, str(TESTS_ROOT), env.get("PYTHONPATH", "")])
    return env


def cli(*args: str, env: dict | None = None, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``python -m shmsync ARGS``; its result (asserting exit 0 with ``check``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "shmsync", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def run_script(*args: str, timeout: float = 240) -> str:
    """Run ``python ARGS`` from the checkout's root, unbuffered; its output (asserting exit 0)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, *args], cwd=CHECKOUT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout
