"""The ``shmsync`` command: ``shmsync ls``, ``shmsync gc`` and ``shmsync new-secret``.

Exit codes: 0 done; 2 a wrong command line; 1 ``new-secret`` could not write its file (one line
on stderr says why).
"""

from __future__ import annotations

import argparse
import json
import sys

from ._secret import write_secret_file
from ._segment import PREFIX, human_bytes
from .host import collect_garbage, is_garbage, is_orphaned, scan


def _age(s: float | None) -> str:
    if s is None:
        return "never"
    if s < 120:
        return f"{s:.1f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.0f}h"


def _state(s) -> str:
    if not s.valid:
        return "incomplete" + (" garbage" if is_garbage(s) else "")
    if is_garbage(s):
        return "garbage"  # nobody holds it: `shmsync gc`
    if is_orphaned(s):
        return "orphaned"  # readers outlived the trainer: `shmsync gc --orphaned`
    return "in use"


def _table(stores) -> str:
    head = ["NAME", "VERSION", "PAYLOAD", "SHM", "CREATOR", "READERS", "LAST PUBLISH", "STATE"]
    rows = [head]
    for s in stores:
        rows.append(
            [
                s.name,
                str(s.version),
                human_bytes(s.payload_bytes),
                human_bytes(s.shm_bytes),
                f"{s.creator_pid} ({'alive' if s.creator_alive else 'gone'})",
                str(len(s.readers)),
                _age(s.last_publish_age_s) + (" ago" if s.last_publish_age_s is not None else ""),
                _state(s),
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _report_skipped(skipped: list[tuple[str, str]]) -> None:
    # Names are escaped: a file name can hold a newline or a terminal escape sequence.
    for name, why in skipped:
        print(f"shmsync: skipped {ascii(PREFIX + name)}: {why}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="shmsync", description="Inspect and clean up shmsync stores on this host.", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("ls", help="list every store on this host")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    gc = sub.add_parser("gc", help="remove stores that no live process holds")
    gc.add_argument("names", nargs="*", metavar="NAME", help="only these stores (default: every store on this host)")
    gc.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    gc.add_argument(
        "--orphaned",
        action="store_true",
        help="also remove stores that readers still hold but nobody can publish to (they keep their weights)",
    )
    gc.add_argument("--json", action="store_true", help="machine-readable output")
    new = sub.add_parser(
        "new-secret", help="write a new random relay secret to a new file only you can read (mode 0600)"
    )
    new.add_argument("path", metavar="FILE", help="the file to create (an existing one is never replaced)")
    args = parser.parse_args(argv)

    if args.command == "new-secret":
        try:
            write_secret_file(args.path)
        except OSError as e:
            print(f"shmsync: cannot write a secret to {ascii(args.path)}: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"wrote a new relay secret to {args.path} (mode 0600); point SHMSYNC_RELAY_SECRET_FILE at it")
        return 0

    stores, skipped = scan()
    _report_skipped(skipped)
    if args.command == "ls":
        if args.json:
            print(json.dumps([s.as_dict() for s in stores], indent=2))
        elif stores:
            print(_table(stores))
        else:
            print("no shmsync stores on this host")
        return 0

    removed = collect_garbage(dry_run=args.dry_run, orphaned=args.orphaned, names=args.names or None, stores=stores)
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, "removed": [s.as_dict() for s in removed]}, indent=2))
    else:
        verb = "would remove" if args.dry_run else "removed"
        for s in removed:
            print(f"{verb} {s.name} ({human_bytes(s.shm_bytes)}, {_state(s)})")
        print(f"{verb} {len(removed)} store(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
