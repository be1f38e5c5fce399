"""The ``shmsync`` command: ``shmsync ls``, ``shmsync ls NAME``, ``shmsync gc`` and ``shmsync new-secret``.

Exit codes (each error is one line on stderr): 0 done (also a watch ended with Ctrl-C); 1
``new-secret`` could not write its file; 2 a wrong command line; 3 no store of that name; 4 a
store file that is not this user's alone, or whose header is not a valid store's.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Callable

from shmsync.core.pages import human_bytes
from shmsync.core.segment import PREFIX
from shmsync.errors import ShmSyncError, StoreNotFoundError
from shmsync.tools.host import collect_garbage, collect_side_files, is_garbage, is_orphaned, scan, table
from shmsync.tools.secret_file import write_secret_file

NOT_FOUND, BAD_STORE = 3, 4


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
    state = "orphaned" if is_orphaned(s) else "in use"  # orphaned: readers outlived the trainer
    return state + (", unlinked" if s.unlinked else "")


def _table(stores) -> str:
    head = ["NAME", "VERSION", "PAYLOAD", "RESIDENT", "SIZE", "GPU", "CREATOR", "READERS", "LAST PUBLISH", "STATE"]
    rows = [head]
    for s in stores:
        rows.append(
            [
                s.name,
                str(s.version),
                human_bytes(s.payload_bytes),
                human_bytes(s.resident_bytes),
                human_bytes(s.shm_bytes),
                human_bytes(s.device_bytes) if s.device_bytes else "-",
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shmsync", description="Inspect and clean up shmsync stores on this host.", allow_abbrev=False
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser(
        "ls",
        help="list every store on this host, or every reader of one store",
        description="Without NAME: every store on this host (unlinked ones that processes still hold too). "
        "With NAME: the readers' table of that store, worst lagging first, readers on other hosts included.",
    )
    ls.add_argument("name", nargs="?", metavar="NAME", help="the store whose readers to list")
    ls.add_argument("--json", action="store_true", help="machine-readable output (see the docs' Operations page)")
    ls.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=1.0,
        metavar="SECONDS",
        help="redraw in place every SECONDS (default 1) until Ctrl-C",
    )
    ls.add_argument("--limit", type=int, default=50, metavar="N", help="readers shown at most (default 50)")
    ls.add_argument("--all", action="store_true", help="show every reader")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    command = {"new-secret": _new_secret, "ls": _ls, "gc": _gc}[args.command]
    return command(args, parser)


def _new_secret(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        write_secret_file(args.path)
    except OSError as e:
        print(f"shmsync: cannot write a secret to {ascii(args.path)}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote a new relay secret to {args.path} (mode 0600); point SHMSYNC_RELAY_SECRET_FILE at it")
    return 0


def _ls(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.watch is not None and not args.watch > 0:
        parser.error(f"--watch takes a number of seconds > 0, got {args.watch}")
    if args.limit < 1:
        parser.error(f"--limit takes a number >= 1, got {args.limit}")
    height = shutil.get_terminal_size().lines if args.watch is not None else None
    if args.name is None:
        render = _store_list(args.json)
    else:
        render = _reader_table(args.name, args.json, None if args.all else args.limit)
    try:
        first = render(height)
    except ValueError as e:  # an invalid name
        print(f"shmsync: {e}", file=sys.stderr)
        return 2
    except StoreNotFoundError as e:
        print(f"shmsync: {e}", file=sys.stderr)
        return NOT_FOUND
    except ShmSyncError as e:
        print(f"shmsync: {e}", file=sys.stderr)
        return BAD_STORE
    if args.watch is None:
        print(first)
        return 0
    return _watch(render, first, args.watch)


def _gc(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    stores, skipped = scan()
    _report_skipped(skipped)
    removed = collect_garbage(dry_run=args.dry_run, orphaned=args.orphaned, names=args.names or None, stores=stores)
    files = collect_side_files(dry_run=args.dry_run) if not args.names else []
    if args.json:
        doc = {"dry_run": args.dry_run, "removed": [s.as_dict() for s in removed], "removed_files": files}
        print(json.dumps(doc, indent=2))
        return 0
    verb = "would remove" if args.dry_run else "removed"
    for s in removed:
        print(f"{verb} {s.name} ({human_bytes(s.shm_bytes)}, {_state(s)})")
    for file in files:
        print(f"{verb} {file} (beside a store that is gone)")
    print(f"{verb} {len(removed)} store(s)")
    return 0


def _store_list(as_json: bool) -> Callable[[int | None], str]:
    def render(height: int | None) -> str:
        stores, skipped = scan()
        _report_skipped(skipped)
        if as_json:
            return json.dumps([s.as_dict() for s in stores], indent=2)
        return _table(stores) if stores else "no shmsync stores on this host"

    return render


def _reader_table(name: str, as_json: bool, limit: int | None) -> Callable[[int | None], str]:
    def render(height: int | None) -> str:
        found = table(name, processes=True)
        if as_json:
            return json.dumps(found.as_dict(), indent=2)
        most = limit if height is None else max(1, min(limit or height, height - 4))
        return found.format(most)

    return render


def _watch(render: Callable[[int | None], str], first: str, every: float) -> int:
    """Redraw ``render``'s text in place every ``every`` seconds, like ``top``, until Ctrl-C."""
    out = sys.stdout
    text = first
    try:
        while True:
            stamp = time.strftime("%H:%M:%S")
            out.write(f"\x1b[H\x1b[2J{text}\n\n{stamp}, every {every:g} s; Ctrl-C to stop\n")
            out.flush()
            time.sleep(every)
            try:
                text = render(shutil.get_terminal_size().lines)
            except StoreNotFoundError as e:
                out.write(f"\nshmsync: {e}\n")
                return NOT_FOUND
    except KeyboardInterrupt:
        out.write("\n")
        return 0


if __name__ == "__main__":
    sys.exit(main())
