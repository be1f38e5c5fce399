"""When a collector's updates are published, so that its workers' next work runs the trainer's
weights as they are when that work is handed out, as TorchRL's default scheme gives them
(:class:`HandOuts`).

* An update with no weights, on the thread that iterates a collector whose workers wait between
  batches (``MultiSyncCollector``), is published when the collector hands out the next batch: no
  worker runs the weights before that, and TorchRL's default scheme shows them the trainer's
  weights as they are then. One copy of what training changed per batch, whichever order the loop
  updates and trains in. Its version is reserved at the call (TorchRL's tracker is told it); the
  end of the iteration (``break``, the last batch), or a read of the workers' weights
  (``collector.state_dict()``), publishes it first; shutdown drops it with the workers.
* Any other update (weights passed, ``worker_ids``, another thread, workers that collect all along)
  is published before the call returns; where it named no weights, the next hand-out on its thread
  publishes again what training changed since, and says once where the workers ran older weights
  than TorchRL's default would have (:class:`~shmsync.errors.FreshnessWarning`).

Only updates made on the iterating thread are published at its hand-out: an update from another
thread marks where that thread's writes stand whole, and its snapshot stays what the workers run (a
copy taken at the hand-out could catch that thread in the middle of writing the weights, where no
copy can tell it is). A copy taken at a hand-out is checked, all the same: a write another thread
makes while it is taken is caught (:meth:`~shmsync.WeightStore.publish`, ``checked=True``).
"""

from __future__ import annotations

import collections
import threading
import warnings
from collections.abc import Collection, Generator
from dataclasses import dataclass
from typing import Any

from shmsync.errors import FreshnessWarning
from shmsync.torchrl import compat
from shmsync.torchrl.publisher import Publisher
from shmsync.writer.role import check_version


@dataclass
class Due:
    """An update waiting for its thread's next hand-out: the keys it named, the version it will
    carry, and whether the caller named that version (else it is the one after the last)."""

    keys: set[str]
    version: int | None  # None: each store's next
    numbered: bool


class HandOuts:
    """When one collector's updates are published (see the module's notes), and what is published
    at each hand-out of work.

    Args:
        publisher: the collector's publisher, the route of every publish.
        collector: the TorchRL collector (its kind says whether its workers wait between batches).
    """

    def __init__(self, publisher: Publisher, collector: Any) -> None:
        self.publisher = publisher
        self.collector_type = type(collector).__name__
        self.runs_sent_weights_next = compat.runs_sent_weights_next(collector)
        # Per thread, the keys of its updates to be published at its next hand-out, and their version.
        self.due: dict[int, Due] = {}
        # Keys an update published with no weights since the collector last handed out work, and
        # the thread that named them: at the next hand-out on that thread they are published again
        # where training changed them.
        self.fresh: dict[str, int] = {}
        self.numbered: dict[str, int] = {}  # likewise, but under a version the caller numbered
        self.marks = threading.Lock()  # another thread may update while this one hands out
        self.handing_out = 0  # the thread inside TorchRL's iterator, which updates before it hands out
        self.iterating: collections.Counter[int] = collections.Counter()  # threads with a live iterator
        self.warned = False  # FreshnessWarning: once per collector
        self.hands_out = publisher.pushes is None  # a remote node's pushes are the trainer's
        # Its workers wait between batches: an update is published at the next hand-out.
        self.defers = self.hands_out and self.runs_sent_weights_next
        self.numbered_checked = False

    # -- an update ------------------------------------------------------------------------------
    def update(self, mine: dict[str, Any], worker_ids: Any, version: int | None) -> None:
        """An update of the collector's shmsync keys ``mine`` (key -> weights, or None for the
        key's model): noted for the next hand-out on this thread, or published now."""
        me = threading.get_ident()
        # No weights, no worker_ids, on a thread that iterates a collector whose workers wait
        # between batches, outside TorchRL's own iterator: published at the next hand-out.
        if (
            mine
            and self.defers
            and worker_ids is None
            and self.iterating[me] > 0
            and self.handing_out != me
            and all(w is None for w in mine.values())
        ):
            self._defer(set(mine), version, me)
            return
        if self.handing_out != me:  # an update this thread made before, still waiting: published first
            self.publish_due(me)
        self.publisher.route(mine, worker_ids, given=version)
        if self.hands_out and self.handing_out != me:  # not TorchRL's own update right before a hand-out
            with self.marks:
                for key, w in mine.items():
                    self.fresh.pop(key, None)
                    self.numbered.pop(key, None)
                    if w is None:
                        (self.fresh if version is None else self.numbered)[key] = me

    def _defer(self, keys: set[str], version: int | None, me: int) -> None:
        """Note an update of ``keys`` for the next hand-out on this thread. Under ``version``, if
        given (refused now if not above the last); else the store's next, which TorchRL's tracker,
        where it keeps one (``track_policy_version``), is told now as the batch's version. What
        publishing it would refuse is refused now."""
        publisher = self.publisher
        with self.marks:
            due = self.due.get(me)
            number = None
            if version is not None or publisher.report_version is not None:
                last = due.version if due is not None and due.version is not None else publisher.promised(keys)
                if version is not None:
                    check_version(version, last)
                number = version if version is not None else last + 1
            publisher.check_update(keys, version)
            if due is None:
                self.due[me] = due = Due(set(), None, numbered=False)
            due.keys |= keys
            if number is not None:
                due.version, due.numbered = number, due.numbered or version is not None
            for key in keys:
                self.fresh.pop(key, None)
                self.numbered.pop(key, None)
        if number is not None:
            publisher.tell_tracker(number)

    # -- the hand-out ---------------------------------------------------------------------------
    def batches(self, batches: Generator[Any, None, None]) -> Generator[Any, None, None]:
        """TorchRL's ``batches``, each asked for after the hand-out's publish (:meth:`hand_out`),
        on the thread that iterates them. An update still waiting for a hand-out when the iteration
        ends (the last batch, ``close()`` after a ``break``) is published then."""
        me = threading.get_ident()
        self.iterating[me] += 1
        try:
            while True:
                self.hand_out()
                self.handing_out = me  # TorchRL's own update, right before it hands out, is published now
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                finally:
                    self.handing_out = 0
                yield batch
        finally:
            self.iterating[me] -= 1
            try:
                batches.close()
            finally:
                if self.iterating[me] <= 0:
                    del self.iterating[me]
                    self.publish_due(me)  # nothing is handed out on this thread any more

    def hand_out(self) -> None:
        """The collector is about to hand its workers their next work: publish the updates made on
        this thread since the last hand-out, those deferred (one new version of the trainer's
        models as they are now) and, where an update was published already with no weights, what
        training changed since (nothing changed: nothing published)."""
        me = threading.get_ident()
        self.publish_due(me)
        with self.marks:
            fresh = {k for k, thread in self.fresh.items() if thread == me}
            numbered = {k for k, thread in self.numbered.items() if thread == me}
            self.fresh, self.numbered = {}, {}
        if numbered and not self.numbered_checked:
            self.numbered_checked = True  # compared once: a loop that changes nothing pays it once
            if self.publisher.differs(numbered):
                self._warn(
                    f"update_policy_weights_(version=...) published {sorted(numbered)} before the weights were "
                    "changed again, and a version the caller numbers cannot be published once more at the next "
                    "batch: the workers run the weights as they were at that call, older than TorchRL's default "
                    "scheme would give them. Call update_policy_weights_() after the optimizer steps, or leave "
                    "version= out"
                )
        if fresh:
            self._publish_fresh(fresh)

    def publish_due(self, thread: int) -> None:
        """Publish the update ``thread`` made that waits for a hand-out (if any): one new version of
        its keys' models, said where another thread's writes kept every copy from being whole (the
        workers then run the newest version there is). Called at the hand-out, when the iteration
        ends (nothing is handed out on that thread any more), and before the workers' weights are
        read (``state_dict``)."""
        with self.marks:
            due = self.due.pop(thread, None)
        if due is None:
            return
        # The number noted, unless another thread published past it meanwhile and none was given.
        number = due.version
        if number is not None and not due.numbered:
            number = max(number, self.publisher.promised(due.keys) + 1)
        _, written = self.publisher.route_models(due.keys, version=number)
        if written:
            self._warn(
                f"the weights of {written} were being written by another thread each time shmsync copied "
                "them as the collector handed out work, so the update_policy_weights_() made before published "
                "nothing: its workers run the newest version there was. Publish from the thread that writes "
                "them, or pass them: update_policy_weights_(weights)"
            )

    def _publish_fresh(self, keys: Collection[str]) -> None:
        """The hand-out's publish of ``keys``, where their models changed; said once where the
        workers ran older weights than TorchRL's default would have given them."""
        published, written = self.publisher.route_models(set(keys), if_changed=True)
        if written:
            self._warn(
                f"the weights of {written} were being written by another thread each time shmsync copied "
                "them as the collector handed out work: its workers run the snapshot update_policy_weights_() "
                "took. Publish from the thread that writes them, or pass them: update_policy_weights_(weights)"
            )
        if published and not self.runs_sent_weights_next:
            self._warn(
                f"{self.collector_type}'s workers collect while the trainer trains: the training done after "
                "update_policy_weights_() reached them only now, as the next batch was asked for (TorchRL's default "
                "scheme shows it to them at every optimizer step, unversioned). Call update_policy_weights_() after "
                "the optimizer steps for fresher weights"
            )

    def drop(self) -> None:
        """The collector shut down: its workers run nothing more, and the updates waiting go with them."""
        with self.marks:
            self.due = {}

    def _warn(self, message: str) -> None:
        if not self.warned:
            self.warned = True
            warnings.warn(message, FreshnessWarning, stacklevel=5)


__all__ = ["Due", "HandOuts"]
