"""A parent and the child that watches it with ``exit_with_parent``: the child must end with it."""

from __future__ import annotations

import os
import time


def watching_child(parent: int, conn) -> None:
    from shmsync import exit_with_parent

    exit_with_parent(parent)  # explicit: the parent may be gone before this line runs
    conn.send(("watching", os.getpid()))
    time.sleep(3600)


def parent_of_a_watching_child(conn) -> None:
    """Starts a child that calls exit_with_parent() and tells ``conn`` it watches, then waits to
    be killed (the child must follow)."""
    import multiprocessing as mp

    child = mp.get_context("spawn").Process(target=watching_child, args=(os.getpid(), conn), daemon=False)
    child.start()
    time.sleep(3600)
