"""What a copying reader's module holds, and a reload that copies only what changed since.

A reader that keeps a private copy of the weights (``zero_copy=False``, a reader in place that
found no slot to lease, a module on a GPU) holds one version ``r`` in its module's tensors. The
slot it loads next holds a version ``v``, and that slot's record (:mod:`shmsync.core.header`)
says, per tensor, a version ``c`` at or after which the tensor last changed, as of ``v``. When
``0 <= c <= r <= v``, the tensor holds the same bytes in ``r`` as in ``v``: the module has them
already, *provided it still holds version r's bytes*. A reload copies the others.

Proving that the module still holds them
-----------------------------------------
The reader's own process may have written its module since it loaded it: TorchRL's
``load_state_dict`` in a worker, the user's code, ``.data``, a NumPy view, an optimizer, a buffer
that the module writes in its forward pass, another thread. So a tensor is left as it is only when
one of two proofs says that its bytes equal the slot's:

* **Written pages** (:mod:`shmsync.core.written_pages`, Linux 6.7+), for the tensors of this
  process's private memory large enough to be worth it (:data:`TRACK_MIN_BYTES`): tracked from
  the moment a reload leaves them holding ``r``, until the next reload looks which of their pages
  were written since. None written, and the tensor's memory still where it was tracked (its data
  pointer and strides): it holds ``r``'s bytes, at no cost. Some written: the bytes on those
  pages are compared with the slot's (a neighbour's write to a page the tensor shares costs a short
  comparison, not a copy). Tracking one tensor or many is one look, whatever writes them: the
  kernel sees every write through this process's page tables.
* **Comparison**: every other tensor on the CPU (in memory shared with other processes or
  page-locked, just moved, or where tracking is unavailable: ``SHMSYNC_WRITE_TRACKING=0``) is
  compared with the slot's, byte for byte (``memcmp``: it stops at the first byte that differs).
  A comparison proves what it reads, whatever happened before.

Tensors smaller than :data:`TRACK_MIN_BYTES` (biases, norms) are copied at every reload, with no
proof: copied together in one batch they cost less than a comparison each (a call per tensor,
and the same bytes read), and they are a sliver of a model's bytes.

A tensor that a reload copies is let go first (a copy into a protected page costs a fault), and
one copied because it changed stays untracked, compared, until it was found unchanged
:data:`COOL_AFTER` times in a row: a trained head that changes at every publish is copied at
every reload and needs no proof.

A module on a GPU copies every tensor at every reload. The kernel cannot see writes to device
memory, and the only reference to compare with lies in host memory: a comparison would move the
same bytes over the bus as the copy it would save (or hold a second copy of the weights in device
memory). The device slots carry no records: a reader copying from them copies all too.

Why a reload holds exactly the version it says
----------------------------------------------
* The records read are the slot's own: they are read inside the copy, between the two loads of
  the slot's sequence number, and the writer writes them inside the write that changes the slot
  (:meth:`shmsync.writer.store.StoreWriter._copy_changes`): a copy that validates read the
  records of the version it accepted, as it read its bytes.
* A record is never below the truth (any path that fills a slot without knowing what changed
  records every tensor as changed at that version), so ``c <= r`` proves equal bytes in ``r`` and
  ``v``; ``r <= v`` is checked (a reader that moves between banks may hold a newer version than a
  slot it reads).
* A copy that fails validation may have written torn bytes into the tensors it copied: those are
  copied again by every later attempt of the same reload, whatever the records of the slot it
  reads then say. A reload that raises, a first load, a reader back from running in place: every
  tensor is copied (``version`` -1).
* The proof is taken before the copy (the look) and holds until the next: the module must not be
  written *during* a reload (the rule :class:`~shmsync.WeightReader` states: no other thread runs
  it while it polls).

``tests/core/protocol_model.py`` checks the first three over every interleaving of a writer
writing only what a slot lacks and a reader copying only what changed, crashes included.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from shmsync.core import written_pages
from shmsync.core.protocol import SlotReader
from shmsync.core.written_pages import TrackedRange, WrittenPages
from shmsync.store.copies import copy_all, same_all
from shmsync.store.memory import StoreMemory

TRACK_MIN_BYTES = 64 << 10  # smaller tensors are copied at every reload: a proof of them would cost more
COOL_AFTER = 2  # reloads a tensor copied because it changed must be found unchanged before it is tracked again
PROOFS = ("none: every tensor copied", "comparison", "written pages")


class _Leaf:
    """What is known of one tensor of the module since the last reload."""

    __slots__ = ("tracked", "where", "changing", "still", "untrackable")

    def __init__(self) -> None:
        self.tracked: TrackedRange | None = None  # its pages, while tracked
        self.where: tuple = ()  # its memory when it was tracked: (address, strides)
        self.changing = False  # copied lately because it changed: compared, not tracked
        self.still = 0  # reloads in a row it was not copied
        self.untrackable = 0  # the address it was found not trackable at (0: never)


class HeldCopy:
    """A module's private copy of a store's weights: the version it holds, and reloads that copy
    only the tensors that changed since (see the module's notes). Held by the reader's
    :class:`~shmsync.reader.binding.Binding`.

    Args:
        memory: the store's mapping in this process.
        targets: the module's tensors, matched against the layout at ``indices``.
        indices: their entries in the store's layout.
        slots: per slot, a view of every entry in layout order (what is copied from).
        records: the slots carry records (the host slots; the device slots do not).

    Attributes:
        version: the version every tensor of the module holds, as far as this process knows
            (-1: not known; the next reload copies everything).
        copied_bytes: bytes the last reload copied into the module (all its attempts).
        skipped_bytes: bytes of the module the last reload did not copy (proved unchanged).

    Examples:
        >>> import torch
        >>> from shmsync import WeightReader, WeightStore
        >>> policy = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 2))
        >>> with WeightStore.create(policy) as store:
        ...     reader = WeightReader(store, torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 2)),
        ...                           zero_copy=False)
        ...     _ = reader.poll()  # the first load copies everything
        ...     with torch.no_grad():
        ...         _ = policy[1].weight.add_(1.0)  # only the head trains
        ...     _ = store.publish(policy)
        ...     _ = reader.poll()
        ...     reader.copied_bytes < 10_000 < reader.skipped_bytes
        True
    """

    def __init__(
        self,
        memory: StoreMemory,
        targets: list[torch.Tensor],
        indices: list[int],
        slots: Sequence[list[torch.Tensor]],
        *,
        records: bool,
    ) -> None:
        self.targets, self.indices, self.slots = targets, indices, slots
        self.on_cpu = not any(t.is_cuda for t in targets)
        self.records = memory.records if records and self.on_cpu else None
        self.words = memory.host
        self.entries = len(memory.layout.entries)
        self.nbytes = [t.numel() * t.element_size() for t in targets]
        self.small = [n < TRACK_MIN_BYTES for n in self.nbytes]  # copied at every reload
        self.version = -1
        self.copied_bytes = 0
        self.skipped_bytes = 0
        self.why_compared = written_pages.unavailable_reason()
        self._leaves = [_Leaf() for _ in targets]
        self._pages: list[WrittenPages] = []  # this process's tracker, once a tensor is tracked
        weakref.finalize(self, _untrack_all, self._pages, self._leaves)

    @property
    def proof(self) -> str:
        """How the tensors a reload leaves as they are were proved unchanged: ``"written pages"``
        (and comparison for those not tracked), ``"comparison"`` (write tracking unavailable here:
        :attr:`why_compared` says why), or ``"none: every tensor copied"`` (a GPU module, or the
        device slots)."""
        if self.records is None:
            return PROOFS[0]
        return PROOFS[1] if self.why_compared is not None else PROOFS[2]

    def load(self, slot_reader: SlotReader, timeout: float) -> int:
        """Load the newest complete version into the module through ``slot_reader`` (a seqlock
        copy, or a pinned one), copying only what it lacks; returns the version.

        Raises:
            ReloadTimeoutError: no copy validated within ``timeout`` seconds (the module's
                contents are then not known: the next reload copies everything).
        """
        held = self.version if self.records is not None else -1
        looked = self._look() if held >= 0 else {}
        touched: set[int] = set()  # written by an attempt of this reload
        picked: list[int] = []
        copied = 0

        def copy(slot: int) -> None:
            nonlocal copied
            picked[:] = self._pick(slot, held, looked, touched)
            self._let_go(picked)
            touched.update(picked)
            views = self.slots[slot]
            if picked:
                copy_all([self.targets[i] for i in picked], [views[self.indices[i]] for i in picked], self.on_cpu)
                copied += sum(self.nbytes[i] for i in picked)

        try:
            version = slot_reader.read(copy, timeout=timeout)
        except BaseException:
            self.forget()
            raise
        self.version, self.copied_bytes = version, copied
        self.skipped_bytes = sum(self.nbytes) - sum(self.nbytes[i] for i in picked)
        if self.records is not None:
            self._settle(set(picked), full=held < 0)
        return version

    def forget(self) -> None:
        """The module's contents are not known any more (it ran in place, or a reload failed):
        the next reload copies everything. Its tensors stop being tracked."""
        self.version = -1
        _untrack_all(self._pages, self._leaves)

    def close(self) -> None:
        """Stop tracking the module's tensors (the reader is closed)."""
        self.forget()

    # -- internal ----------------------------------------------------------------------------------
    def _pick(self, slot: int, held: int, looked: dict[int, list[tuple[int, int]]], touched: set[int]) -> list[int]:
        """Inside the copy of ``slot`` (between the loads of its sequence number): the tensors to
        copy, those the module may lack. All of them when the version it holds is not known, or
        newer than the slot's; else those the slot's record says changed since, those an earlier
        attempt wrote, and those no proof says hold the slot's bytes."""
        n = len(self.targets)
        h, words, records = self.words.h, self.words, self.records
        if held < 0 or records is None or held > h[words.slot_version[slot]]:
            return list(range(n))
        base, views, small = slot * self.entries, self.slots[slot], self.small
        record = records[base : base + self.entries]
        picked, compare = [], []
        for i, index in enumerate(self.indices):
            if small[i] or not 0 <= record[index] <= held or i in touched:
                picked.append(i)  # small, changed since the version held, or written by a failed attempt
                continue
            spans = looked.get(i)
            if spans is None or spans:  # not tracked (compared whole), or pages of it written since
                compare.append((i, views[index], spans))
        return picked + self._differing(compare)

    def _differing(self, compare: list[tuple[int, torch.Tensor, list[tuple[int, int]] | None]]) -> list[int]:
        """Of ``compare`` (tensor, the slot's view of it, and the spans of it to compare: None for
        all), the tensors whose bytes differ from the slot's, or that are not laid out plainly on the
        CPU; the comparisons run as one batch (split across threads when large)."""
        picked, which, ranges = [], [], []
        for i, view, spans in compare:
            t = self.targets[i]
            if t.device.type != "cpu" or not t.is_contiguous() or not view.is_contiguous():
                picked.append(i)
                continue
            a, b = t.data_ptr(), view.data_ptr()
            for offset, n in spans if spans is not None else [(0, self.nbytes[i])]:
                which.append(i)
                ranges.append((a + offset, b + offset, n))
        if ranges:
            picked += sorted({i for i, same in zip(which, same_all(ranges)) if not same})
        return picked

    def _look(self) -> dict[int, list[tuple[int, int]]]:
        """The tracked tensors' written spans since the last reload; a tensor whose memory moved
        since it was tracked, or whose pages the tracker lost, is let go, and answers nothing."""
        pages = self._pages[0] if self._pages else None
        if pages is None:
            return {}
        leaves = self._leaves
        moved = [
            i
            for i, (leaf, t) in enumerate(zip(leaves, self.targets))
            if leaf.tracked is not None and (t.data_ptr(), t.stride()) != leaf.where
        ]
        self._let_go(moved)
        tracked = [(i, leaf.tracked) for i, leaf in enumerate(leaves) if leaf.tracked is not None]
        looked = {}
        for (i, _), spans in zip(tracked, pages.look([r for _, r in tracked]) if tracked else []):
            if spans is None:
                leaves[i].tracked = None  # its memory went, or was left behind by a fork: compared
            else:
                looked[i] = spans
        return looked

    def _let_go(self, ids: list[int]) -> None:
        """Stop tracking these tensors (before a copy writes them: no fault, no report of it)."""
        ranges = []
        for i in ids:
            leaf = self._leaves[i]
            if leaf.tracked is not None:
                ranges.append(leaf.tracked)
                leaf.tracked = None
        if ranges and self._pages:
            self._pages[0].untrack(ranges)

    def _settle(self, picked: set[int], full: bool) -> None:
        """After a reload that holds its version: which tensors are changing (copied because they
        changed), and tracking, until the next reload, the others that are not tracked yet."""
        for i, leaf in enumerate(self._leaves):
            if self.small[i]:
                continue
            if i in picked and not full:
                leaf.changing, leaf.still = True, 0
            else:
                leaf.still += 1
                leaf.changing = leaf.changing and leaf.still < COOL_AFTER
        if self.why_compared is None:
            self._track()

    def _track(self) -> None:
        wanted = []
        for i, (leaf, t) in enumerate(zip(self._leaves, self.targets)):
            if self.small[i]:
                continue
            if leaf.tracked is None and not leaf.changing and leaf.untrackable != t.data_ptr():
                if _trackable(t):
                    wanted.append(i)
                else:
                    leaf.untrackable = t.data_ptr()  # compared while its memory stays there
        if not wanted:
            return
        if not self._pages or not self._pages[0].usable:
            try:
                self._pages[:] = [written_pages.for_this_process()]
            except OSError as e:  # refused after all (WriteTrackingError): every tensor is compared
                self.why_compared = str(e)
                return
        spans = [(self.targets[i].data_ptr(), self.nbytes[i]) for i in wanted]
        for i, tracked in zip(wanted, self._pages[0].track(spans)):
            leaf, t = self._leaves[i], self.targets[i]
            if tracked.unknown is None:
                leaf.tracked, leaf.where = tracked, (t.data_ptr(), t.stride())
            else:
                leaf.untrackable = t.data_ptr()


def _trackable(t: torch.Tensor) -> bool:
    """Whether the pages under ``t`` (not small) may be tracked: private CPU memory laid out
    plainly, with no device copying into it behind the page tables' back (page-locked memory)."""
    if t.device.type != "cpu" or t.is_shared():
        return False
    return t.is_contiguous() and not t.is_pinned()


def _untrack_all(pages: list[WrittenPages], leaves: list[_Leaf]) -> None:
    """Let every tracked tensor go (a reader closed, forgotten or collected)."""
    ranges = [leaf.tracked for leaf in leaves if leaf.tracked is not None]
    for leaf in leaves:
        leaf.tracked = None
    if ranges and pages and pages[0].usable:
        pages[0].untrack(ranges)
