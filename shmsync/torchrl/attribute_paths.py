"""Resolving source paths such as ``"loss_module.actor_network"`` or ``"replay_buffer.transform[0]"``."""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from typing import Any

from shmsync.errors import InvalidArgumentError, UnknownAttributeError

_TOKEN = re.compile(r"(\.)?([A-Za-z_][A-Za-z0-9_]*)|\[([^\]]+)\]")


def split_path(path: str) -> list[tuple[str, str | int]]:
    """``"a.b[0]['k']"`` -> ``[("attr", "a"), ("attr", "b"), ("item", 0), ("item", "k")]``.

    Raises:
        ValueError: the path is not a chain of attributes and ``[int]`` / ``['key']`` subscripts.
    """
    parts: list[tuple[str, str | int]] = []
    pos = 0
    while pos < len(path):
        m = _TOKEN.match(path, pos)
        if m is None or (m.group(2) is not None and bool(m.group(1)) != bool(parts)):
            raise InvalidArgumentError(f"cannot parse path {path!r} at position {pos}")
        if m.group(2) is not None:
            parts.append(("attr", m.group(2)))
        else:
            try:
                index = ast.literal_eval(m.group(3).strip())
            except (ValueError, SyntaxError):
                index = None
            if not isinstance(index, (int, str)) or isinstance(index, bool):
                raise InvalidArgumentError(f"path {path!r}: subscript [{m.group(3)}] must be an int or a quoted string")
            parts.append(("item", index))
        pos = m.end()
    if not parts or parts[0][0] != "attr":
        raise InvalidArgumentError(f"cannot parse path {path!r}: it must start with an attribute name")
    return parts


def resolve_path(root: Any, path: str, fallback: Callable[[Any, str], Any] | None = None) -> Any:
    """Follow ``path`` from ``root``.

    Args:
        root: the object the path starts from.
        path: attributes and ``[int]`` / ``['key']`` subscripts, e.g. ``"a.b[0]"``.
        fallback: ``fallback(obj, name)`` looks up a name that is not an attribute of ``obj``
            (say, a module added with ``Trainer.register_module``); it raises AttributeError if
            it has none either.

    Raises:
        AttributeError: naming the part of the path that does not resolve.
        ValueError: the path cannot be parsed.
    """
    obj = root
    done = ""
    for kind, part in split_path(path):
        try:
            obj = obj[part] if kind == "item" else _getattr(obj, str(part), fallback)
        except (AttributeError, KeyError, IndexError, TypeError) as e:
            raise UnknownAttributeError(
                f"path {path!r} does not resolve: {repr(done) if done else 'the root'} ({type(obj).__name__}) has no "
                f"{'item' if kind == 'item' else 'attribute'} {part!r} ({type(e).__name__}: {e})"
            ) from None
        done += f"[{part!r}]" if kind == "item" else (f".{part}" if done else str(part))
    return obj


def _getattr(obj: Any, name: str, fallback: Callable[[Any, str], Any] | None) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        if fallback is None:
            raise
        return fallback(obj, name)
