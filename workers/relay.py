"""One host's relay: receives the trainer's versions over torch.distributed and publishes each
into this host's store, under the trainer's version number (see :mod:`shmsync.relay`).

Run one per host besides the trainer's, then start that host's workers on the same store name::

    export SHMSYNC_RELAY_SECRET_FILE=~/.shmsync-secret   # or SHMSYNC_RELAY_SECRET=...
    python -m shmsync.workers.relay --connect 10.0.0.1:29600 --store policy
    python -m shmsync.workers.launch --store policy --num-workers 8

Exit codes: 0 when the trainer closed its sender; 3 when the trainer went away mid-run; 4 when
this host's store holds another model than the trainer's (nothing written); 5 when the trainer
(or a relay it pointed at) does not hold this relay's secret.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from shmsync.errors import AuthenticationError, StoreNotFoundError, TrainerGoneError, WeightMismatchError
from shmsync.relay import Relay, read_secret_file

EXIT_TRAINER_GONE, EXIT_MISMATCH, EXIT_AUTH = 3, 4, 5
REASONS = {
    0: "the trainer closed its sender",
    EXIT_TRAINER_GONE: "the trainer went away",
    EXIT_MISMATCH: "this host's store holds another model than the trainer's",
    EXIT_AUTH: "the trainer does not hold this relay's secret",
}


def relay_exit_reason(code: int | None) -> str:
    """What a relay process's exit code means, in words."""
    if code is not None and code < 0:
        return f"killed by signal {-code}"
    return REASONS.get(code, f"exit code {code}")


def _relay_process(address: str, port: int, store: str, secret: str | bytes | None) -> None:
    from shmsync import exit_with_parent

    exit_with_parent()  # the launcher gone, its relay goes too
    raise SystemExit(_run(Relay(address, port, store=store, secret=secret)))


def start_relay(ctx: Any, connect: str, store: str, timeout: float, secret: str | bytes | None = None) -> Any:
    """Start this host's relay in a process of ``ctx``; return it once it created (or found)
    ``store``.

    Raises:
        RuntimeError: the relay ended first (its reason), or ``timeout`` seconds passed.
    """
    from shmsync import WeightStore

    address, _, port = connect.rpartition(":")
    if not address or not port.isdigit():
        raise ValueError(f"relay wants ADDRESS:PORT, got {connect!r}")
    proc = ctx.Process(target=_relay_process, args=(address, int(port), store, secret), daemon=False)
    proc.start()
    deadline = time.monotonic() + timeout
    while True:
        try:
            WeightStore.attach(store).close()
            return proc
        except StoreNotFoundError:
            pass
        if not proc.is_alive():
            raise RuntimeError(
                f"this host's relay ended before store {store!r} existed: {relay_exit_reason(proc.exitcode)}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            proc.join(5)
            raise RuntimeError(f"this host's relay did not create store {store!r} within {timeout:.0f} s")
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shmsync.workers.relay", description=__doc__.splitlines()[0])
    parser.add_argument("--connect", required=True, help="ADDRESS:PORT of the trainer's RelaySender")
    parser.add_argument("--store", required=True, help="name of this host's store (created if it does not exist)")
    parser.add_argument(
        "--secret-file",
        default=None,
        help="file holding the relay secret, readable only by you (default: $SHMSYNC_RELAY_SECRET, "
        "else the file $SHMSYNC_RELAY_SECRET_FILE)",
    )
    parser.add_argument(
        "--listen",
        default="auto",
        help="ADDRESS:PORT to feed other relays from; 'auto' (default): this host's address towards the "
        "trainer, any port; 'none': feed none",
    )
    parser.add_argument("--num-slots", type=int, default=4, help="slots of a store created here")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to keep trying to reach the trainer")
    args = parser.parse_args(argv)
    address, _, port = args.connect.rpartition(":")
    if not address or not port.isdigit():
        parser.error(f"--connect wants ADDRESS:PORT, got {args.connect!r}")
    listen: Any = args.listen
    if listen == "none":
        listen = None
    elif listen != "auto":
        host, _, lport = listen.rpartition(":")
        if not host or not lport.isdigit():
            parser.error(f"--listen wants ADDRESS:PORT, 'auto' or 'none', got {listen!r}")
        listen = (host, int(lport))
    try:
        secret = read_secret_file(args.secret_file) if args.secret_file else None
        relay = Relay(
            address, int(port), store=args.store, secret=secret, listen=listen, num_slots=args.num_slots,
            timeout=args.timeout,
        )  # fmt: skip
    except (ValueError, PermissionError, OSError) as e:
        parser.error(str(e))
    return _run(relay)


def _run(relay: Relay) -> int:
    try:
        relay.run()
    except TrainerGoneError as e:
        print(f"relay: {e}; exiting", file=sys.stderr)
        return EXIT_TRAINER_GONE
    except WeightMismatchError as e:
        print(f"relay: {e}", file=sys.stderr)
        return EXIT_MISMATCH
    except AuthenticationError as e:
        print(f"relay: {e}", file=sys.stderr)
        return EXIT_AUTH
    finally:
        relay.close()
    print(f"relay: the trainer closed its sender after {relay.received} versions", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
