"""Start and stop a pool of rollout worker processes attached to a store.

    python -m shmsync.workers.launch --store NAME --num-workers 2 --env CartPole-v1 --device cpu --batches 10

On a host other than the trainer's, ``--relay ADDRESS:PORT`` (``relay=`` from Python) first
starts this host's relay (see :mod:`shmsync.relay`), which creates the store from the trainer's
current version; the workers start once it exists, and stop when the relay ends.

As a library::

    with launch(store.name, num_workers=2, env="CartPole-v1") as pool:
        for worker_id, batch in pool.batches():
            ...
"""

from __future__ import annotations

import argparse
import os
import queue as queue_module
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch.multiprocessing as mp

from shmsync import WeightStore
from shmsync.errors import InvalidArgumentError, ShmSyncError, StoreNotFoundError, WaitTimeoutError, WeightMismatchError

from .collector import WorkerConfig, run_worker
from .relay import one_line, relay_exit_reason, start_relay


class WorkerPool:
    """N spawned collector processes and the queue their batches arrive on.

    Args:
        config: what every worker runs (store name, env, device, policy factory...).
        num_workers: how many processes.
        devices: one device per worker (overrides ``config.device``), e.g. ``["cuda:0", "cuda:1"]``.
        relay: ``"ADDRESS:PORT"`` of the trainer's :class:`~shmsync.relay.RelaySender`: start
            this host's relay first, and stop the workers when it ends (the trainer closed its
            sender: :meth:`batches` ends; the trainer died: it raises).
        relay_timeout: seconds to wait for the relay to create the store.
        relay_secret: the relay secret (default: ``$SHMSYNC_RELAY_SECRET``, else the file named by
            ``$SHMSYNC_RELAY_SECRET_FILE``).

    Examples:
        >>> pool = WorkerPool(WorkerConfig(store="my-store"), num_workers=2)  # doctest: +SKIP
        >>> for worker_id, batch in pool.batches(max_batches=10):  # doctest: +SKIP
        ...     print(worker_id, batch["policy_version"].unique())
        >>> pool.stop()  # doctest: +SKIP
    """

    def __init__(
        self,
        config: WorkerConfig,
        num_workers: int,
        devices: list[str] | None = None,
        *,
        relay: str | None = None,
        relay_timeout: float = 120.0,
        relay_secret: str | bytes | None = None,
    ) -> None:
        if num_workers < 1:
            raise InvalidArgumentError(f"num_workers must be >= 1, got {num_workers}")
        if devices is not None and len(devices) != num_workers:
            raise InvalidArgumentError(f"got {len(devices)} devices for {num_workers} workers")
        if relay is None:
            # A missing or unreadable store fails here, at once, not in every worker once it
            # has imported torch and TorchRL.
            WeightStore.attach(config.store).close()
        ctx = mp.get_context("spawn")
        self.config = config
        self.queue = ctx.Queue(maxsize=2 * num_workers)
        self.reloads: dict[int, int] = {}
        self._started: set[int] = set()  # their SIGTERM handler is in place
        self._exited: set[int] = set()  # said goodbye: stopped cleanly
        self._failed: set[int] = set()  # reported an error
        self._backlog: list[tuple[str, int, Any]] = []  # batches read while looking for an error
        self._checked = 0.0  # when the workers' liveness was last checked
        self.procs = []
        self.relay = None if relay is None else start_relay(ctx, relay, config.store, relay_timeout, relay_secret)
        for i in range(num_workers):
            cfg = replace(config, device=devices[i]) if devices else config
            proc = ctx.Process(target=run_worker, args=(i, cfg, self.queue, os.getpid()), daemon=False)
            proc.start()
            self.procs.append(proc)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]  # started: each has one

    def batches(self, max_batches: int | None = None, timeout: float = 120.0) -> Iterator[tuple[int, Any]]:
        """Yield ``(worker_id, batch)`` as workers produce them.

        Raises:
            Exception: a worker failed (say, it could not attach to the store, make its env or
                build a policy that matches the store): that worker's own exception, raised as
                soon as it arrives, with the worker's traceback in its notes.
            RuntimeError: a worker died without a word (killed, crashed): its exit code or signal.
            TimeoutError: no batch arrived for ``timeout`` seconds while every worker was alive.
        """
        n = 0
        quiet_since = time.monotonic()
        while max_batches is None or n < max_batches:
            if self.relay is not None and not self.relay.is_alive():
                code = self.relay.exitcode
                self.stop()
                if code == 0:
                    return  # the trainer closed its sender: no more versions will come
                raise ShmSyncError(f"this host's relay ended: {relay_exit_reason(code)}; workers stopped")
            message = self._next_message()
            if message is None:
                if time.monotonic() - quiet_since >= timeout:
                    raise WaitTimeoutError(f"no batch from any worker for {timeout}s")
                continue
            quiet_since = time.monotonic()
            kind, worker_id, payload = message
            n += 1
            yield worker_id, payload

    def _next_message(self, poll: float = 0.25) -> tuple[str, int, Any] | None:
        """The next batch message, or None after ``poll`` seconds; raises a worker's failure."""
        if self._backlog:
            return self._backlog.pop(0)
        message = self._get(poll)
        if message is not None:
            message = self._handle(message)
        # Also while other workers keep the queue busy, at most every `poll` seconds.
        if message is None or time.monotonic() - self._checked >= poll:
            self._checked = time.monotonic()
            dead = self._silently_dead()
            if dead is not None:
                if message is not None:
                    self._backlog.append(message)
                self._blame(dead)
        return message

    def _blame(self, dead: int) -> None:
        # Its last words may still be in flight: read what is there before blaming it.
        self._read_remaining(grace=1.0)
        if dead not in self._failed:
            p = self.procs[dead]
            code = p.exitcode
            how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            raise ShmSyncError(f"worker {dead} (pid {p.pid}) died with {how}")

    def _get(self, timeout: float) -> tuple[str, int, Any] | None:
        """The next message on the queue, or None after ``timeout`` seconds."""
        try:
            return self.queue.get(timeout=timeout)
        except queue_module.Empty:
            return None
        except (EOFError, ConnectionError, FileNotFoundError):
            # A batch whose worker died after sending it: its shared tensors are passed as file
            # descriptors that only the sender can hand over, so the batch is lost. Its death is
            # reported by the liveness check.
            return None

    def _handle(self, message: tuple[str, int, Any]) -> tuple[str, int, Any] | None:
        kind, worker_id, payload = message
        if kind == "error":
            self._failed.add(worker_id)
            raise payload
        if kind == "exit":
            self.reloads[worker_id] = payload
            self._exited.add(worker_id)
            return None
        if kind == "started":
            self._started.add(worker_id)
            return None
        return message

    def _silently_dead(self) -> int | None:
        for i, p in enumerate(self.procs):
            if i not in self._exited and i not in self._failed and not p.is_alive():
                return i
        return None

    def _read_remaining(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            message = self._get(0.05)
            if message is None:
                continue
            message = self._handle(message)
            if message is not None:
                self._backlog.append(message)

    def stop(self, timeout: float = 30.0) -> dict[int, int | None]:
        """SIGTERM every worker (each finishes its rollout), then kill stragglers.

        Returns:
            ``{worker_id: exit code}``; 0 for a clean exit.
        """
        deadline = time.monotonic() + timeout
        # A worker still starting has no SIGTERM handler yet: a SIGTERM would kill it mid-import.
        self._drain_while(deadline, lambda i, p: i not in self._started and i not in self._failed)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        self._drain_while(deadline, lambda i, p: True)
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        self._drain()
        if self.relay is not None and self.relay.is_alive():
            self.relay.terminate()  # after the workers: they read its store to the end
            self.relay.join(5)
        return {i: p.exitcode for i, p in enumerate(self.procs)}

    def _drain_while(self, deadline: float, waiting_for: Callable[[int, Any], bool]) -> None:
        """Keep the queue moving until no live worker is one ``waiting_for(index, process)`` names,
        or ``deadline`` (``time.monotonic()``)."""
        while time.monotonic() < deadline and any(p.is_alive() and waiting_for(i, p) for i, p in enumerate(self.procs)):
            self._drain()
            time.sleep(0.02)

    def _drain(self) -> None:
        # Workers flush their queue before exiting: keep it moving so they can.
        while True:
            try:
                kind, worker_id, payload = self.queue.get_nowait()
            except (queue_module.Empty, ValueError):
                return
            except (EOFError, ConnectionError, FileNotFoundError):
                continue  # a batch whose worker has exited: see _get
            except OSError:
                return
            if kind == "exit":
                self.reloads[worker_id] = payload
                self._exited.add(worker_id)
            elif kind == "started":
                self._started.add(worker_id)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def launch(
    store: str,
    num_workers: int,
    env: str = "CartPole-v1",
    device: str = "cpu",
    *,
    devices: list[str] | None = None,
    **config: Any,
) -> WorkerPool:
    """Start ``num_workers`` collector processes that attach to ``store`` by name.

    Keyword arguments go to :class:`~shmsync.workers.collector.WorkerConfig` (``frames_per_batch``,
    ``policy``, ``destination``, ``seed``, ``zero_copy``...).

    Raises:
        StoreNotFoundError: no store of that name on this host, checked before any worker starts
            (with ``relay=`` the relay creates it).
    """
    relay, secret = config.pop("relay", None), config.pop("relay_secret", None)
    return WorkerPool(
        WorkerConfig(store=store, env=env, device=device, **config), num_workers, devices, relay=relay,
        relay_secret=secret,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shmsync.workers.launch", description=" ".join(__doc__.split("\n\n")[0].split())
    )
    parser.add_argument("--store", required=True, help="name of the trainer's store")
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--device", default="cpu", help="cpu, cuda:0, ...")
    parser.add_argument("--frames-per-batch", type=int, default=200)
    parser.add_argument(
        "--policy", default="shmsync.workers.policies:mlp_policy", help="module:function(env) -> module"
    )
    parser.add_argument(
        "--batches", type=int, default=None, help="stop after this many batches (default: run until Ctrl-C)"
    )
    parser.add_argument(
        "--private-copy",
        action="store_true",
        help="each CPU worker keeps a copy of the weights of its own (for a policy that writes its weights); "
        "by default CPU workers run on the store's memory in place",
    )
    parser.add_argument("--zero-copy", action="store_true", help=argparse.SUPPRESS)  # the default now
    parser.add_argument("--relay", default=None, help="ADDRESS:PORT of the trainer's RelaySender (another host)")
    args = parser.parse_args(argv)
    try:
        pool = launch(
            args.store,
            args.num_workers,
            args.env,
            args.device,
            frames_per_batch=args.frames_per_batch,
            policy=args.policy,
            zero_copy=False if args.private_copy else None,
            relay=args.relay,
        )
    except (ShmSyncError, ValueError) as e:  # WeightMismatchError is a ValueError
        return _fail(e)
    try:
        for worker_id, batch in pool.batches(args.batches):
            versions = batch["policy_version"].unique().tolist()
            print(f"worker {worker_id}: {batch.numel()} frames, versions {versions}", flush=True)
    except KeyboardInterrupt:
        pass
    except Exception as e:  # a worker's own error, raised here: one line, not two tracebacks
        return _fail(e)
    finally:
        codes = pool.stop()
    print(f"workers stopped: exit codes {codes}, reloads {pool.reloads}")
    return 0 if all(c == 0 for c in codes.values()) else EXIT_FAILED


# The command's exit codes (docs/getting-started.md, which a test reads beside these): 0 the batches
# asked for were collected, or Ctrl-C; 1 a worker failed (its error in one line); 2 a wrong command
# line (argparse's); 3 no such store; 4 the policy does not match the store.
EXIT_FAILED, EXIT_NO_STORE, EXIT_MISMATCH = 1, 3, 4


def _fail(error: BaseException) -> int:
    code = EXIT_FAILED
    if isinstance(error, StoreNotFoundError):
        code = EXIT_NO_STORE
    elif isinstance(error, WeightMismatchError):
        code = EXIT_MISMATCH
    print(f"launch: {type(error).__name__}: {one_line(error)}", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
