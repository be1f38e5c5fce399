"""A trainer process with a pool of standalone workers, killed by the test: its workers must follow."""

from __future__ import annotations

import time

from shmsync import WeightStore


def pool_parent(conn) -> None:
    """A trainer that launches two workers, then waits to be killed (its workers must follow)."""
    from shmsync.workers.launch import launch
    from shmsync.workers.policies import make_env, mlp_policy

    store = WeightStore.create(mlp_policy(make_env("CartPole-v1")))
    pool = launch(store.name, 2, "CartPole-v1", frames_per_batch=50)
    next(pool.batches(1))
    conn.send(("running", store.name, pool.pids))
    time.sleep(3600)
