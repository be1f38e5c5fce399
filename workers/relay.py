"""One host's relay: receives the trainer's versions over its relay link and publishes each into
this host's store, under the trainer's version number.

Run one per host besides the trainer's (see :mod:`shmsync.relay`), then start that host's workers
on the same store name::

    shmsync new-secret ~/.shmsync-secret                 # once; copy it to every host
    export SHMSYNC_RELAY_SECRET_FILE=~/.shmsync-secret
    python -m shmsync.workers.relay --connect 10.0.0.1:29600 --store policy
    python -m shmsync.workers.launch --store policy --num-workers 8

Exit codes, each with one line on stderr saying why (never a traceback): 0 the trainer closed
its sender; 1 an unexpected error; 2 a wrong command line or secret; 3 the trainer went away
mid-run (or no version came for ``--timeout`` seconds while re-attaching); 4 this host's store
holds another model than the trainer's (nothing written); 5 the trainer (or a relay it pointed
at) does not hold this relay's secret, wants the other ``--plaintext-inside-tunnel`` setting, or
sent a frame that failed its check; 6 the trainer broke the protocol (nothing it sent was
published); 7 this host cannot hold the store (no room in its shared memory); 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

from shmsync.errors import (
    AuthenticationError,
    InvalidArgumentError,
    ProtocolError,
    RelayError,
    ShmSyncError,
    StoreCorruptError,
    StoreNotFoundError,
    TrainerGoneError,
    WeightMismatchError,
)
from shmsync.tools.secret_file import read_secret_file, resolve_secret

if TYPE_CHECKING:
    from shmsync.relay import Relay

# shmsync.relay (and torch with it) is imported once the command line checked out: a wrong one
# is answered at once.

EXIT_ERROR, EXIT_USAGE, EXIT_TRAINER_GONE, EXIT_MISMATCH, EXIT_AUTH, EXIT_PROTOCOL, EXIT_NO_ROOM = 1, 2, 3, 4, 5, 6, 7
REASONS = {
    0: "the trainer closed its sender",
    EXIT_ERROR: "an unexpected error",
    EXIT_USAGE: "a wrong command line or secret",
    EXIT_TRAINER_GONE: "the trainer went away",
    EXIT_MISMATCH: "this host's store holds another model than the trainer's",
    EXIT_AUTH: "the trainer does not hold this relay's secret (or its frames failed their check)",
    EXIT_PROTOCOL: "the trainer broke the relay protocol",
    EXIT_NO_ROOM: "this host cannot hold the store",
    130: "interrupted",
}


def relay_exit_reason(code: int | None) -> str:
    """What a relay process's exit code means, in words."""
    if code is not None and code < 0:
        return f"killed by signal {-code}"
    return REASONS.get(code, f"exit code {code}") if code is not None else "still running"


def _relay_process(address: str, port: int, store: str, secret: str | bytes | None) -> None:
    from shmsync import exit_with_parent
    from shmsync.relay import Relay

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
        raise InvalidArgumentError(f"relay wants ADDRESS:PORT, got {connect!r}")
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
            raise ShmSyncError(
                f"this host's relay ended before store {store!r} existed: {relay_exit_reason(proc.exitcode)}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            proc.join(5)
            raise ShmSyncError(f"this host's relay did not create store {store!r} within {timeout:.0f} s")
        time.sleep(0.02)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--secret" or a.startswith("--secret=") for a in argv):
        # argparse would echo the value in its error: a secret never goes on a command line.
        print(
            "python -m shmsync.workers.relay: --secret is not an option: a secret on a command line shows in the "
            "process list; use --secret-file FILE or $SHMSYNC_RELAY_SECRET_FILE",
            file=sys.stderr,
        )
        return EXIT_USAGE
    parser = argparse.ArgumentParser(
        prog="python -m shmsync.workers.relay",
        description=" ".join(__doc__.split("\n\n")[0].split()),
        allow_abbrev=False,
    )
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
    parser.add_argument(
        "--plaintext-inside-tunnel",
        action="store_true",
        help="plain frames, as the trainer's RelaySender(encrypt=False): only for links inside a tunnel that "
        "encrypts (WireGuard, SSH), never across a network you do not trust",
    )
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
        # Where it comes from, checked before anything is imported.
        secret = resolve_secret(secret, given_as="pass --secret-file FILE")[0]
    except (ValueError, PermissionError, OSError) as e:
        parser.error(str(e))
    from shmsync.relay import Relay

    try:
        relay = Relay(
            address, int(port), store=args.store, secret=secret, listen=listen, num_slots=args.num_slots,
            timeout=args.timeout, encrypt=not args.plaintext_inside_tunnel,
        )  # fmt: skip
    except (ValueError, PermissionError, OSError, ImportError) as e:
        parser.error(str(e))
    return _run(relay)


# What each way of ending means, most specific first (WeightMismatchError is a ValueError).
_ENDINGS: list[tuple[tuple[type[BaseException], ...], int]] = [
    ((TrainerGoneError,), EXIT_TRAINER_GONE),
    ((WeightMismatchError,), EXIT_MISMATCH),
    ((AuthenticationError,), EXIT_AUTH),
    ((ProtocolError, StoreCorruptError, RelayError), EXIT_PROTOCOL),
    ((OSError, OverflowError, MemoryError), EXIT_NO_ROOM),
    ((KeyboardInterrupt,), 130),
    ((Exception,), EXIT_ERROR),
]


def _run(relay: Relay) -> int:
    """Run ``relay``; its exit code, with one line on stderr saying how it ended."""
    try:
        relay.run()
    except BaseException as e:
        code = next((code for kinds, code in _ENDINGS if isinstance(e, kinds)), None)
        if code is None:
            raise  # SystemExit and the like
        print(f"relay: {type(e).__name__}: {one_line(e)}; exiting ({REASONS[code]})", file=sys.stderr)
        return code
    finally:
        relay.close()
    print(f"relay: the trainer closed its sender after {relay.received} versions", file=sys.stderr)
    return 0


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:1000]


if __name__ == "__main__":
    raise SystemExit(main())
