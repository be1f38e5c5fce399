"""The file descriptors a process holds open (a segment must close every one it opened)."""

from __future__ import annotations

import os


def open_fds(under=None) -> set[int]:
    """This process's open file descriptors; with ``under``, only those open on a file in that
    folder (all a test can answer for: threads that earlier tests left in the same process, a
    relay's or Ray's, open and close descriptors of their own meanwhile)."""
    folder = None if under is None else f"{os.path.realpath(under)}{os.sep}"
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        if folder is not None:
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # closed meanwhile, or listdir's own
                continue
            if not target.startswith(folder):
                continue
        fds.add(int(fd))
    return fds
