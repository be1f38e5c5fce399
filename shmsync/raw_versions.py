"""Whole versions as bytes, for moving them between hosts: a store made from another store's
layout description whose first version is written straight into a slot, a version written
straight from a socket into a free slot, and a listener on each version this process commits.

This is how a relay publishes on its host (:mod:`shmsync.relay`), with no copy in between; it is
the store's plumbing, kept off :class:`~shmsync.WeightStore`'s public face, and uses the store's
package-internal writer helpers.

Examples:
    >>> import torch
    >>> from shmsync import WeightStore
    >>> from shmsync.raw_versions import create_from_bytes, publish_bytes
    >>> with WeightStore.create(torch.nn.Linear(2, 2)) as source:
    ...     ones = lambda buffer: buffer.cast("B").__setitem__(slice(None), b"\\x01" * len(buffer))
    ...     with create_from_bytes(source.layout_description, ones, version=5, name="raw-example") as copy:
    ...         publish_bytes(copy, ones, version=6), copy.version
    (6, 6)
"""

from __future__ import annotations

from collections.abc import Callable

from shmsync.core.layout import Layout
from shmsync.core.segment import Segment, validate_name
from shmsync.store import WeightStore, check_version


def create_from_bytes(
    layout_description: bytes,
    fill: Callable[[memoryview], None],
    *,
    version: int,
    name: str,
    num_slots: int = 3,
    unlink_at_exit: bool = True,
) -> WeightStore:
    """A store laid out as ``layout_description`` says (a store's :attr:`~WeightStore.layout_description`),
    whose first version's bytes ``fill(view)`` writes straight into a slot: how a relay makes the
    store of a host from the trainer's first version.

    The store gets its name only once it holds that version, in one step: no process can attach
    to it before, so nothing on this host ever reads any other first version.

    Raises:
        StoreCorruptError: the description fails a check (naming the field).
        FileExistsError: ``name`` was taken meanwhile (nothing is left behind).
        Exception: whatever ``fill`` raised (nothing is left behind).
    """
    check_version(version)
    validate_name(name)
    layout, destinations = Layout.from_json(layout_description, "the layout to make a store from")
    store = WeightStore._create_empty(
        layout,
        destinations,
        lambda _name, size, head, reserve_bytes, track: Segment.create_incoming(
            size, head, reserve_bytes=reserve_bytes, track=track
        ),
        name,
        num_slots,
        unlink_at_exit,
    )
    try:
        publish_bytes(store, fill, version=version)
        store.memory.segment.link(name)
    except BaseException:
        store.unlink()
        store.close()
        raise
    return store


def publish_bytes(store: WeightStore, fill: Callable[[memoryview], None], *, version: int) -> int:
    """Publish into ``store`` a version whose bytes ``fill(buffer)`` writes straight into a free slot.

    ``buffer`` is a writable memoryview of :attr:`~WeightStore.nbytes` bytes in the store's layout,
    valid while ``fill`` runs. If ``fill`` raises, the slot is left empty and nothing is published.

    Returns:
        ``version``.

    Raises:
        ValueError: ``version`` is not higher than the last one; nothing is written.
        WriterBusyError: another live process holds the writer role.
    """
    store._check_open()
    store._check_next_version(version)
    store._claim_writer()
    memory = store.memory
    protocol = memory.protocol
    write = protocol.begin_write()
    try:
        with memory.slot_buffer(write.slot, writable=True) as buffer:
            fill(buffer)
    except BaseException:
        protocol.abort(write)
        raise
    return memory.commit(write, version)


def add_publish_listener(store: WeightStore, listener: Callable[[int], None]) -> None:
    """Call ``listener(version)`` each time a version published from this process into ``store``
    becomes visible, in the thread that made it visible, right after (a relay's links wake on it
    instead of polling). It must return at once and never raise."""
    store.memory.protocol.listeners.append(listener)


def remove_publish_listener(store: WeightStore, listener: Callable[[int], None]) -> None:
    """Undo :func:`add_publish_listener`."""
    listeners = store.memory.protocol.listeners
    if listener in listeners:
        listeners.remove(listener)


__all__ = ["add_publish_listener", "create_from_bytes", "publish_bytes", "remove_publish_listener"]
