"""A store made from another store's layout description, its first version written straight into a
slot from the bytes that arrive: how a relay makes its host's store from the trainer's first version
(:mod:`shmsync.relay`), with no copy in between. The versions after it go the same way, through
:meth:`~shmsync.WeightStore.publish_bytes`; the store wakes each link of a relay's server as a
version commits (:meth:`~shmsync.WeightStore.add_listener`).

Examples:
    >>> import torch
    >>> from shmsync import WeightStore
    >>> from shmsync.relay.raw_versions import create_from_bytes
    >>> with WeightStore.create(torch.nn.Linear(2, 2)) as source:
    ...     ones = lambda buffer, write: buffer.cast("B").__setitem__(slice(None), b"\\x01" * len(buffer))
    ...     with create_from_bytes(source.memory.layout_description, ones, version=5, name="raw-example") as copy:
    ...         copy.publish_bytes(ones, version=6), copy.version
    (6, 6)
"""

from __future__ import annotations

from collections.abc import Callable

from shmsync.core.protocol import Write
from shmsync.core.segment import Segment, validate_name
from shmsync.store.layout import Layout
from shmsync.writer.role import check_version
from shmsync.writer.store import WeightStore


def create_from_bytes(
    layout_description: bytes,
    fill: Callable[[memoryview, Write], None],
    *,
    version: int,
    name: str,
    num_slots: int = 3,
    unlink_at_exit: bool = True,
) -> WeightStore:
    """A store laid out as ``layout_description`` says (its memory's ``layout_description``),
    whose first version's bytes ``fill(buffer, write)`` writes straight into a slot (see
    :meth:`~shmsync.WeightStore.publish_bytes`): how a relay makes the
    store of a host from the trainer's first version.

    The store gets its name only once it holds that version, in one step: no process can attach
    to it before, so nothing on this host ever reads any other first version.

    Raises:
        StoreCorruptError: the description fails a check (naming the field).
        FileExistsError: ``name`` was taken meanwhile (nothing is left behind).
        Exception: whatever ``fill`` raised (nothing is left behind).
    """
    check_version(version, -1)
    validate_name(name)
    layout, destinations = Layout.from_json(layout_description, "the layout to make a store from")

    def incoming(_name: str, size: int, head: int, reserve_bytes: int, track: bool) -> Segment:
        return Segment.create_incoming(size, head, reserve_bytes=reserve_bytes, track=track)

    store = WeightStore.create_empty(
        layout, destinations, name, num_slots=num_slots, unlink_at_exit=unlink_at_exit, make_segment=incoming
    )
    try:
        store.publish_bytes(fill, version=version)
        store.memory.segment.link(name)
    except BaseException:
        store.unlink()
        store.close()
        raise
    return store


__all__ = ["create_from_bytes"]
