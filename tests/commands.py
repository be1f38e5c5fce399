"""Every command a test starts is built and started here: a child interpreter (``python(ARGS)``,
this interpreter, never one found on the PATH), the ``shmsync`` command (``cli``), the checkout's
scripts (``run_script``) and the tools a test calls (make, git, lint-imports), run to their end
(``run_command``, output captured as text) or started (``start_command``). ``CHECKOUT`` is the checkout whose files
the tests read (its docs, examples and sources): the folder above this one, or ``SHMSYNC_CHECKOUT``
when the tests run from a copy against an installed shmsync (``make test``'s shipped legs)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

# The folder that holds the ``tests`` package: on a child interpreter's path, ``import tests.x`` works.
TESTS_ROOT = Path(__file__).resolve().parents[1]
CHECKOUT = Path(os.environ.get("SHMSYNC_CHECKOUT") or TESTS_ROOT)
# The commands installed with this interpreter (``shmsync``, ``lint-imports``), whatever the PATH says.
BIN = Path(sys.executable).parent


def with_tests_importable(env: dict[str, str] | None = None, *first: str) -> dict[str, str]:
    """``env`` (default: this process's) with ``first`` and then :data:`TESTS_ROOT` ahead on
    ``PYTHONPATH``, for a child interpreter that imports the tests' helpers by name."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([*first, str(TESTS_ROOT), env.get("PYTHONPATH", "")])
    return env


def python(*args: str) -> list[str]:
    """The command line ``python ARGS`` of this interpreter (a venv's, a leg's, the wheel's)."""
    return [sys.executable, *args]


def run_command(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    input: str | None = None,
    timeout: float = 60,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` to its end, its output captured as text; with ``check``, assert that it
    exited 0 (the end of its output in the message)."""
    proc = subprocess.run(list(command), env=env, cwd=cwd, input=input, capture_output=True, text=True, timeout=timeout)
    if check:
        said = proc.stdout[-3000:] + proc.stderr[-3000:]
        assert proc.returncode == 0, f"{list(command[:3])} exited {proc.returncode}: {said}"
    return proc


def start_command(
    command: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdin: int | None = None,
    stdout: int | IO[str] | None = None,
    stderr: int | IO[str] | None = None,
    new_session: bool = False,
) -> subprocess.Popen[str]:
    """Start ``command`` in the background, text in and out; ``new_session`` puts it in a process
    group of its own (what a terminal's Ctrl-C reaches). The caller waits on it or kills it."""
    return subprocess.Popen(
        list(command), env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=True,
        start_new_session=new_session,
    )  # fmt: skip


def cli(*args: str, env: dict | None = None, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``python -m shmsync ARGS``; its result (asserting exit 0 with ``check``)."""
    proc = run_command(python("-m", "shmsync", *args), env=env, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def run_script(*args: str, timeout: float = 240) -> str:
    """Run ``python ARGS`` from the checkout's root, unbuffered; its output (asserting exit 0)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = run_command(python(*args), cwd=CHECKOUT, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout
