"""Which tensors of a list changed since they were last looked at, and how the others are proved
unchanged: the one place that decides it, for a writer's source (what a publish copies:
:mod:`shmsync.writer.changes`) and for a copying reader's module (what a reload copies:
:mod:`shmsync.reader.held_copy`).

A tensor (a *leaf*) counts as unchanged only when every one of its bytes is proved equal to a
reference's (the store's newest version, a slot), whatever wrote it: an optimizer step of any
kind, an in-place op, ``.data``, a NumPy view, ``load_state_dict``, another thread. Two proofs,
each exact (:class:`~shmsync.core.header.Proof`):

* **Written pages** (:mod:`shmsync.core.written_pages`, Linux 6.7+): the kernel says which pages of
  the leaf's memory were written since the last look; a leaf none of whose pages was written is
  unchanged, at no cost. The bytes on a written page are compared, so a neighbour's write to a
  page the leaf shares (small tensors sit beside other objects), or a write of the same bytes (a
  ``load_state_dict`` of an unchanged checkpoint), costs a comparison, not a copy. Only leaves of
  :data:`TRACK_MIN_BYTES` or more, in this process's private memory, are tracked. A watch may
  leave a leaf's *edges* (its first and last page, which it shares with its neighbours) out of
  the tracking and compare its bytes on them at every look instead: where the neighbours are
  written at every look (a copying reader's reload writes the small tensors beside the large
  ones), a tracked edge page would fault on each of those writes and be protected again at each
  look.
* **Comparison**: the leaf's bytes against the reference's (``memcmp``, split across idle cores
  when large, as integers of the element's size where a view is needed: ``-0.0`` and ``0.0``, or
  two NaNs of different payloads, differ). It stops at the first byte that differs: a leaf an
  optimizer stepped costs almost nothing to find changed; an unchanged one costs one read of both.

Tracking is not free either: the first write to each tracked page costs a fault (about three
times what copying the page costs). So a leaf found changed stops being tracked (*changing*), and
is tracked again once found unchanged :data:`COOL_AFTER` times in a row. Looks may be taken at
several kinds of *moment* (a collector's update, its hand-out of work): a changing leaf may still
be quiet over the stretch after one kind of moment, and is tracked over those stretches alone. A
leaf whose memory moved (``p.data = other``) since it was tracked is let go and compared.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import cast

import torch

from shmsync.core import written_pages
from shmsync.core.header import Proof
from shmsync.core.page_map import PAGE
from shmsync.core.written_pages import Spans, TrackedRange, WrittenPages
from shmsync.store.copies import same_all

TRACK_MIN_BYTES = 64 << 10  # smaller leaves are compared (or copied): tracking them saves next to nothing
COOL_AFTER = 2  # looks a changing leaf must be found unchanged in a row before it is tracked again

# The integer type of each element size: a leaf's bytes compared as integers of its own width.
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same_bytes(source: torch.Tensor, held: torch.Tensor) -> bool:
    """Whether ``source`` holds exactly the bytes of ``held`` (same shape and dtype, on the same device).

    Examples:
        >>> import torch
        >>> same_bytes(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0]))
        True
        >>> same_bytes(torch.tensor([-0.0]), torch.tensor([0.0]))  # equal values, other bytes
        False
    """
    if source.device != held.device or source.dtype != held.dtype or source.shape != held.shape:
        return False
    if source.device.type == "cpu" and source.is_contiguous() and held.is_contiguous():
        return same_all([(source.data_ptr(), held.data_ptr(), source.numel() * source.element_size())])[0]
    a, b = _as_ints(source), _as_ints(held)
    return a is not None and b is not None and torch.equal(a, b)


def _as_ints(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` viewed as integers of its element size (no copy), or None where torch cannot."""
    if t.is_complex():
        t = torch.view_as_real(t)
    ints = _INTS.get(t.element_size())
    if ints is None:
        return None
    try:
        return t.view(ints)
    except RuntimeError:  # a dtype torch cannot view bit for bit
        return None


def _trackable(t: torch.Tensor) -> bool:
    """Whether the pages under ``t`` may be tracked: private CPU memory of some size, laid out
    plainly, with no device copying into it behind the page tables' back (page-locked memory)."""
    if not t.is_cpu or t.nbytes < TRACK_MIN_BYTES or t.is_shared():
        return False
    return t.is_contiguous() and not t.is_pinned()


class LeafWatch:
    """What is known of each leaf of a list of tensors since it was last looked at: whether its
    pages are tracked, and whether it is changing (kept only for leaves of
    :data:`TRACK_MIN_BYTES` or more: a look at a model of many small tensors passes over the
    others, which are compared or copied whole). Held by a writer's
    :class:`~shmsync.writer.changes.SourceChanges` and a reader's
    :class:`~shmsync.reader.held_copy.HeldCopy`, one per list; the tensors are passed at each
    call (the same leaves, in the same order: their memory may move between calls).

    Args:
        count: the number of leaves.
        edges_tracked: whether a leaf's edge pages are tracked with the rest (False: only the
            pages it fills whole are, and its bytes on the others are compared at each look).

    Attributes:
        why_compared: why write tracking is unavailable here (None: it is available), so that
            every leaf is compared.

    Examples:
        >>> import torch
        >>> watch = LeafWatch(2)
        >>> leaves = [torch.zeros(4), torch.ones(1 << 16)]
        >>> reference = [t.clone() for t in leaves]
        >>> watch.differing(leaves, [(0, reference[0], None), (1, reference[1], None)])
        set()
        >>> watch.settle(leaves, [False, False])  # tracks the large leaf, where tracking is available
        >>> leaves[1].data[7] = 2.0  # through .data: torch's version counter does not move
        >>> looked = watch.pages_written(leaves)
        >>> watch.differing(leaves, [(0, reference[0], None), (1, reference[1], looked.get(1))])
        {1}
        >>> watch.close()
    """

    def __init__(self, count: int, *, edges_tracked: bool = True) -> None:
        self.edges_tracked = edges_tracked
        self.tracked: list[TrackedRange | None] = [None] * count
        self.where: list[tuple[int, tuple[int, ...]]] = [(0, ())] * count  # memory when tracked: address, strides
        self.edges: list[Spans] = [[]] * count  # per tracked leaf, its bytes on pages not tracked
        self.changing = [False] * count  # found changed lately: compared, tracked only over quiet stretches
        self.still = [0] * count  # looks in a row it was found unchanged
        self.quiet_after: list[dict[str | None, bool]] = [{} for _ in range(count)]  # per moment
        self.untrackable = [0] * count  # the address it was found not trackable at (0: never)
        self.write_counts = [-1] * count  # torch's version counter (its count of in-place writes) at the last look
        self.sized: list[int] | None = None  # the leaves large enough to track, found at the first settle
        self.why_compared = written_pages.unavailable_reason()
        self._pages: WrittenPages | None = None
        self._moment: str | None = None  # the moment of the last settle

    @property
    def proof(self) -> Proof:
        """How a leaf left as it is was proved unchanged: by the pages written (and a comparison
        where they were written, or for a leaf not tracked), or by a comparison alone."""
        return Proof.COMPARISON if self.why_compared is not None else Proof.WRITTEN_PAGES

    def pages_written(self, tensors: Sequence[torch.Tensor]) -> dict[int, Spans]:
        """Per tracked leaf, the bytes of it to compare: those on its tracked pages written since
        its last look, and its edges where they are not tracked (``[]``: nothing, it is unchanged),
        the written pages protected again. The spans are sorted and apart, but an edge and a
        written page beside it may touch (a leaf's edges are this watch's own list: read it, never
        change it). A leaf whose memory moved since it was tracked, or whose pages the tracker
        lost, is let go and missing from the answer: compare it."""
        pages, tracked, where, edges = self._pages, self.tracked, self.where, self.edges
        if pages is None or self.sized is None:  # nothing tracked yet
            return {}
        ids = [i for i in self.sized if tracked[i] is not None]
        moved = [i for i in ids if (tensors[i].data_ptr(), tensors[i].stride()) != where[i]]
        if moved:
            self.let_go(moved)
            ids = [i for i in ids if tracked[i] is not None]
        looked = {}
        ranges = cast(list[TrackedRange], [tracked[i] for i in ids])  # each of ids is tracked
        for i, r, spans in zip(ids, ranges, pages.look(ranges) if ids else ()):
            if spans is None:
                tracked[i] = None  # its memory went, or a fork left it behind: compared from now on
            else:
                looked[i] = self._with_edges(i, r, spans) if edges[i] else spans
        return looked

    def _with_edges(self, i: int, r: TrackedRange, spans: Spans) -> Spans:
        """Leaf ``i``'s untracked edges, and ``spans`` (within its tracked range ``r``) at its own
        offsets between them."""
        edges = self.edges[i]
        if not spans:  # no page written: its edges alone
            return edges
        head = r.address - self.where[i][0]
        first = edges[: head > 0]
        return [*first, *((o + head, n) for o, n in spans), *edges[len(first) :]]

    def inside(self, i: int, spans: Spans) -> bool:
        """Whether ``spans``, from :meth:`pages_written`, name bytes on leaf ``i``'s tracked pages
        (not only its untracked edges): a write reached those pages since the last look. (The
        spans are its edges and the written pages between them, as :meth:`pages_written` puts
        them together: so one more than its edges.)"""
        return len(spans) > len(self.edges[i])

    def differing(
        self, tensors: Sequence[torch.Tensor], which: Sequence[tuple[int, torch.Tensor, Spans | None]]
    ) -> set[int]:
        """Of the leaves ``which`` names, each with its reference (a slot's view of it) and the
        spans of it to compare (None: all of it), those whose bytes differ from their reference's.
        The comparisons run as one batch, split across threads when large; a leaf not laid out
        plainly on the CPU is compared whole, as integers (:func:`same_bytes`)."""
        differ, ranges, owners = set(), [], []
        for i, r, spans in which:
            t = tensors[i]
            if not (t.is_cpu and r.is_cpu and t.is_contiguous() and r.is_contiguous()):
                if not same_bytes(t, r):
                    differ.add(i)
            elif spans is None:
                ranges.append((t.data_ptr(), r.data_ptr(), t.nbytes))
                owners.append(i)
            else:
                a, b = t.data_ptr(), r.data_ptr()
                for offset, n in spans:
                    ranges.append((a + offset, b + offset, n))
                    owners.append(i)
        if ranges:
            differ.update(i for i, same in zip(owners, same_all(ranges)) if not same)
        return differ

    def settle(
        self,
        tensors: Sequence[torch.Tensor],
        changed: Sequence[bool],
        moment: str | None = None,
        looked: dict[int, Spans] | None = None,
        own: Collection[int] = (),
    ) -> None:
        """After a look at ``moment`` that found, per leaf, whether it ``changed``: which leaves are
        changing, and which are tracked until the next look (track them before their bytes are
        read). A leaf is changing once it changed *or was written*, its bytes the same or not
        (a fault per tracked page each time): torch's version counter moved (every in-place op,
        an optimizer's step), or its own pages (beyond the edge pages it may share) were written,
        as ``looked`` (from :meth:`pages_written`) says; writes the caller made itself (``own``: a reload's
        copy) do not count. A changing leaf is let go (a fault on every page an optimizer steps
        costs more than comparing it), unless the stretch after this kind of moment was quiet
        last time."""
        last, self._moment = self._moment, moment
        if self.sized is None:  # a leaf's size stays (the layout's); a smaller one is never tracked
            self.sized = [i for i, t in enumerate(tensors) if t.nbytes >= TRACK_MIN_BYTES]
        ids = self.sized
        keep = self._keep(ids, self._active(ids, tensors, changed, looked or {}, own), last, moment)
        tracked, untrackable = self.tracked, self.untrackable
        gone = [i for i, k in zip(ids, keep) if not k and tracked[i] is not None]
        wanted = [i for i, k in zip(ids, keep) if k and tracked[i] is None and untrackable[i] != tensors[i].data_ptr()]
        if gone:
            self.let_go(gone)
        if wanted and self.why_compared is None:
            self._track(tensors, wanted)

    def _keep(self, ids: list[int], active: list[bool], last: str | None, moment: str | None) -> list[bool]:
        """Per leaf of ``ids``, from whether it was ``active`` since the ``last`` moment: whether it
        is changing now, and whether to track it over the stretch after this ``moment``."""
        changing, still, quiet_after, keep = self.changing, self.still, self.quiet_after, []
        for i, written in zip(ids, active):
            if changing[i] and last is not None:
                quiet_after[i][last] = not written
            still[i] = 0 if written else still[i] + 1
            changing[i] = written or changing[i] and still[i] < COOL_AFTER
            keep.append(not changing[i] or quiet_after[i].get(moment, False))
        return keep

    def _active(
        self,
        ids: list[int],
        tensors: Sequence[torch.Tensor],
        changed: Sequence[bool],
        looked: dict[int, Spans],
        own: Collection[int],
    ) -> list[bool]:
        """Per leaf of ``ids``, whether it changed or was written since the last look (see
        :meth:`settle`)."""
        write_counts, edges, active = self.write_counts, self.edges, []
        for i in ids:
            t, differs = tensors[i], changed[i]
            count, spans = t._version, looked.get(i)
            moved = count != write_counts[i] >= 0 and i not in own
            # More than two pages of its tracked ones written (its untracked edges left out).
            written = (
                spans is not None
                and len(spans) > len(edges[i])
                and sum(n for _, n in spans) - sum(n for _, n in edges[i]) > 2 * PAGE
            )
            active.append(differs or moved or written)
            write_counts[i] = count
        return active

    def let_go(self, ids: Sequence[int]) -> None:
        """Stop tracking these leaves (before a copy writes them: no fault, no report of it)."""
        ranges = [r for i in ids if (r := self.tracked[i]) is not None]
        for i in ids:
            self.tracked[i] = None
        if ranges and self._pages is not None and self._pages.usable:
            self._pages.untrack(ranges)

    def close(self) -> None:
        """Stop tracking every leaf."""
        self.let_go(range(len(self.tracked)))

    def _track(self, tensors: Sequence[torch.Tensor], wanted: list[int]) -> None:
        ids = []
        for i in wanted:
            t = tensors[i]
            if _trackable(t):
                ids.append(i)
            else:
                self.untrackable[i] = t.data_ptr()  # compared while its memory stays where it is
        if not ids:
            return
        if self._pages is None or not self._pages.usable:
            try:
                self._pages = written_pages.for_this_process()
            except OSError as e:  # refused after all (WriteTrackingError): every leaf is compared
                self.why_compared = str(e)
                return
        spans, edges, whole = [], [], []
        for i in ids:
            address, nbytes = tensors[i].data_ptr(), tensors[i].nbytes
            start, end = address, address + nbytes
            if not self.edges_tracked:  # the pages it fills whole
                start, end = -(-address // PAGE) * PAGE, end // PAGE * PAGE
                if end <= start:  # none (pages of 64 KiB): compared while its memory stays there
                    self.untrackable[i] = address
                    continue
            whole.append(i)
            spans.append((start, end - start))
            head, tail = start - address, address + nbytes - end
            edges.append([(0, head)] * (head > 0) + [(nbytes - tail, tail)] * (tail > 0))
        if not whole:
            return
        for i, r, own_edges in zip(whole, self._pages.track(spans), edges):
            t = tensors[i]
            if r.unknown is None:
                self.tracked[i], self.where[i], self.edges[i] = r, (t.data_ptr(), t.stride()), own_edges
            else:
                self.untrackable[i] = t.data_ptr()


__all__ = ["COOL_AFTER", "TRACK_MIN_BYTES", "LeafWatch", "same_bytes"]
