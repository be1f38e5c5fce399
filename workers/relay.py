"""One host's relay: receives the trainer's versions over torch.distributed and publishes each
into this host's store, under the trainer's version number (see :mod:`shmsync.relay`).

Run one per host besides the trainer's, then start that host's workers on the same store name::

    python -m shmsync.workers.relay --connect 10.0.0.1:29600 --store policy
    python -m shmsync.workers.launch --store policy --num-workers 8

Exit codes: 0 when the trainer closed its sender; 3 when the trainer went away mid-run; 4 when
this host's store holds another model than the trainer's (nothing written).
"""

from __future__ import annotations

import argparse
import sys

from shmsync.errors import WeightMismatchError
from shmsync.relay import Relay, TrainerGoneError

EXIT_TRAINER_GONE, EXIT_MISMATCH = 3, 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shmsync.workers.relay", description=__doc__.splitlines()[0])
    parser.add_argument("--connect", required=True, help="ADDRESS:PORT of the trainer's RelaySender")
    parser.add_argument("--store", required=True, help="name of this host's store (created if it does not exist)")
    parser.add_argument("--num-slots", type=int, default=3, help="slots of a store created here")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the trainer")
    args = parser.parse_args(argv)
    address, _, port = args.connect.rpartition(":")
    if not address or not port.isdigit():
        parser.error(f"--connect wants ADDRESS:PORT, got {args.connect!r}")
    relay = Relay(address, int(port), store=args.store, num_slots=args.num_slots, timeout=args.timeout)
    try:
        relay.run()
    except TrainerGoneError as e:
        print(f"relay: {e}; exiting", file=sys.stderr)
        return EXIT_TRAINER_GONE
    except WeightMismatchError as e:
        print(f"relay: {e}", file=sys.stderr)
        return EXIT_MISMATCH
    finally:
        relay.close()
    print(f"relay: the trainer closed its sender after {relay.received} versions", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
