"""Which of a source's tensors changed since the store's newest version, leaf by leaf: what lets a
publish copy only what changed, and skip a whole version when nothing did.

A leaf counts as *unchanged* only when every one of its bytes is proved equal to the newest
version's, whatever wrote it: an optimizer step of any kind, an in-place op, ``.data``, a NumPy
view, ``load_state_dict``, another thread. Two proofs, each exact:

* **Written pages** (:mod:`shmsync.core.written_pages`, Linux 6.7+): the kernel says which pages of
  the leaf's memory were written since the last look; a leaf none of whose pages was written is
  unchanged, at no cost. The bytes on a written page are compared, so a neighbour's write to a
  page the leaf shares (small tensors sit beside other objects) costs a short comparison, not a
  copy. Only leaves expected to stay unchanged are tracked: the first write to each tracked page
  costs a fault (about three times what copying the page costs), so a leaf found changed stops
  being tracked, and is tracked again once it was found unchanged :data:`COOL_AFTER` times.
* **Comparison**: the leaf's bytes against the newest version's, as integers of its element size
  (so that ``-0.0`` and ``0.0``, or two NaNs of different payloads, differ: a reader must get the
  source's bytes, not equal values). A comparison stops at the first byte that differs: a leaf an
  optimizer stepped costs almost nothing to find changed; an unchanged one costs one read of both.

Every leaf not tracked (small, on a GPU, page-locked, in shared memory, or where tracking is
unavailable) is compared. A leaf whose memory moved (``p.data = other``) counts as changed until
compared. A leaf that changes every step is compared at each publish (cheap: it differs at once);
where it was found unchanged between a publish and the collector's next hand-out (a loop that
trains, then updates), it is tracked over that stretch alone, so the hand-out proves it unchanged
without reading it.

A copy made while another thread may write the source is checked the same way once it is done
(:meth:`SourceChanges.written_since`): every leaf, after every leaf was copied. If each leaf
still holds the bytes it was copied with, no write reached any leaf between its copy and its
check, and all those windows contain the moment between the last copy and the first check: the
slot holds the source's memory as it was at that moment. A comparison cannot see a write that
changes a leaf and puts its exact bytes back within that window; the written pages can. What
neither can tell is where another thread stands in a write of its own: one that sat between two
tensors of an optimizer step for the whole window is caught there, one tensor stepped and the other
not. That is why a collector's hand-out publishes again only updates made by the thread that
iterates it (:meth:`shmsync.torchrl.publishing.CollectorPatches.hand_out`).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from dataclasses import dataclass, field

import torch

from shmsync.core import written_pages
from shmsync.core.written_pages import TrackedRange, WrittenPages

TRACK_MIN_BYTES = 64 << 10  # smaller leaves are compared: tracking them would save next to nothing
COOL_AFTER = 2  # publishes a changing leaf must be found unchanged in a row before it is tracked again
SPANS_COMPARED = 1 << 20  # at most this many bytes on written pages are compared; past it, changed

# The integer type of each element size: a leaf's bytes compared as integers of its own width.
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_memcmp = ctypes.CDLL(None).memcmp
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


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
        # memcmp: as fast as a copy when equal, and it stops at the first byte that differs.
        return _memcmp(source.data_ptr(), held.data_ptr(), source.numel() * source.element_size()) == 0
    a, b = _as_ints(source), _as_ints(held)
    return a is not None and b is not None and torch.equal(a, b)


def others_may_write() -> bool:
    """Whether a thread of this process other than the caller may write a source while the caller
    copies it: any thread that runs Python code, or that Python's ``threading`` knows of, but the
    caller and shmsync's own (each named ``shmsync-...``; they read sources, never write them).
    Torch's own worker threads write only for an operation some such thread started. Where this
    says False, a copy made by the caller is a snapshot without a check.

    Examples:
        >>> import threading
        >>> done = threading.Event()
        >>> writer = threading.Thread(target=done.wait)
        >>> writer.start()
        >>> others_may_write()
        True
        >>> done.set(); writer.join()
    """
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    return any(i != me and not names.get(i, "").startswith("shmsync-") for i in {*names, *sys._current_frames()})


def _span_of(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of memory ``t``'s elements lie in: ``(address, length)``."""
    if t.is_contiguous():
        return t.data_ptr(), t.numel() * t.element_size()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), (last + 1) * t.element_size()


def _trackable(t: torch.Tensor) -> bool:
    """Whether the pages under ``t`` may be tracked: private CPU memory of some size, laid out
    forwards, with no device copying into it behind the page tables' back (page-locked memory)."""
    if t.device.type != "cpu" or t.numel() * t.element_size() < TRACK_MIN_BYTES or t.is_shared():
        return False
    return min(t.stride(), default=1) >= 0 and not t.is_pinned()


@dataclass
class _Leaf:
    """What is known of one leaf of the source since the newest version."""

    where: tuple = ()  # where its memory was when it was tracked: (address, strides)
    tracked: TrackedRange | None = None  # its pages, while tracked
    changing: bool = False  # found changed lately: compared, tracked only over stretches found quiet
    still: int = 0  # looks in a row it was found unchanged
    quiet_after: dict[str, bool] = field(default_factory=dict)  # per moment: was the stretch after it quiet?
    dirty: bool = False  # found to differ from the newest version (a look cleared its pages' record)
    untrackable: int = 0  # where its memory was when it was found not trackable (0: never)


class SourceChanges:
    """Which leaves of a store's source differ from its newest version, for one writer.

    Each look is taken at a *moment* of the caller's loop (``"publish"``, ``"hand-out"``): a leaf
    that changes (an optimizer steps it) may still be quiet over the stretch after one kind of
    moment (from a collector's hand-out to the next update, in a loop that updates before it
    trains), and is tracked over those stretches alone.

    Args:
        size: the number of leaves (the layout's entries).

    Attributes:
        proof: how an unchanged leaf is proved unchanged: ``"written pages"`` or ``"comparison"``
            (write tracking unavailable here: the reason is in :attr:`why_compared`).
        changed_at: per leaf, the version it last changed at (-1: not known; copy it).

    Examples:
        >>> import torch
        >>> changes = SourceChanges(2)
        >>> source = [torch.zeros(4), torch.ones(1 << 16)]
        >>> held = [t.clone() for t in source]
        >>> changes.find(source, held, "publish")
        [False, False]
        >>> source[1].data[7] = 2.0  # through .data: torch's version counter does not move
        >>> changes.find(source, held, "publish")
        [False, True]
    """

    def __init__(self, size: int) -> None:
        self.leaves = [_Leaf() for _ in range(size)]
        self.changed_at = [-1] * size
        self.why_compared = written_pages.unavailable_reason()
        self.proof = "comparison" if self.why_compared is not None else "written pages"
        self._pages: WrittenPages | None = None
        self._found: list[bool] = []
        self._last_moment: str | None = None

    def find(self, source: list[torch.Tensor], held: list[torch.Tensor] | None, moment: str) -> list[bool]:
        """Per leaf, whether ``source[i]`` differs in any byte from ``held[i]``, the newest
        version's slot (None: there is none yet, everything differs), looked at ``moment``. The
        leaves to track until the next look are tracked before this returns: copy them after it."""
        looked, last = self._look(source), self._last_moment
        found = []
        for i, (leaf, s) in enumerate(zip(self.leaves, source)):
            spans = looked.get(i)
            if held is None:
                differs = True
            elif leaf.tracked is not None and not leaf.dirty and spans is not None:
                # Tracked, the newest version's bytes at its last look, its pages' record whole:
                # only the bytes on pages written since can differ.
                differs = bool(spans) and not _spans_equal(s, held[i], spans)
            else:
                differs = not same_bytes(s, held[i])
            # What it says of the leaf from now on: changing, or cooling back to tracked; and, for
            # a changing leaf, whether the stretch since the last moment was quiet.
            if leaf.changing and last is not None:
                leaf.quiet_after[last] = not differs
            leaf.still = 0 if differs else leaf.still + 1
            leaf.changing = differs or leaf.changing and leaf.still < COOL_AFTER
            leaf.dirty = leaf.dirty or differs
            found.append(differs)
        self._track(source, moment)
        self._found, self._last_moment = found, moment
        return found

    def written_since(self, source: list[torch.Tensor], copied: list[torch.Tensor]) -> list[int]:
        """After a copy of ``source`` into ``copied`` (right after :meth:`find`, or after the last
        check of a copy that failed): the leaves a write reached meanwhile, which no longer hold
        what ``copied`` holds of them. Empty: the copy holds one moment of the source.

        A leaf written since :meth:`find` found it unchanged is in the slot as it was before that
        write (it was not copied), so the caller copies it at its next attempt: this check looks
        only at what was written since the one before it.
        """
        looked = self._look(source)
        written = []
        for i, (leaf, s, c) in enumerate(zip(self.leaves, source, copied)):
            spans = looked.get(i)
            if leaf.tracked is not None and spans is not None:
                leaf.dirty = leaf.dirty or bool(spans)  # the look cleared their record: keep it here
                differs = bool(spans) and not _spans_equal(s, c, spans)
            else:
                leaf.dirty = leaf.dirty or i in looked
                differs = not same_bytes(s, c)
            if differs:
                written.append(i)
        return written

    def published(self, version: int, before: int) -> None:
        """The source, as :meth:`find` last saw it, is ``version`` now (``before``: the newest version
        :meth:`find` compared it with, -1 if none): the leaves found changed changed at it, the
        others hold what they held at ``before`` at the latest, and none differs from the newest
        version any more."""
        at = self.changed_at
        for i, (leaf, differs) in enumerate(zip(self.leaves, self._found)):
            if differs:
                at[i] = version
            elif at[i] < 0:
                at[i] = before  # known from now on: the same bytes as that version's
            leaf.dirty = False

    def forget(self) -> None:
        """A version was published by other means (bytes from elsewhere): nothing is known."""
        self.changed_at = [-1] * len(self.leaves)
        for leaf in self.leaves:
            leaf.dirty = True

    def replaced(self, version: int) -> None:
        """``version`` was published whole from bytes from elsewhere: every leaf counts as changed at
        it (exact: a slot holding an older version lacks every leaf, one holding it lacks none), and
        the source, whatever it holds, is compared at its next publish."""
        self.changed_at = [version] * len(self.leaves)
        for leaf in self.leaves:
            leaf.dirty = True

    def published_delta(self, version: int, base: int, changed: list[int]) -> None:
        """``version`` was published from bytes from elsewhere that differ from ``base`` (the newest
        version before it) only in the leaves ``changed``: those changed at ``version``; the others
        hold ``base``'s bytes (known from now on where they were not); the source is compared at its
        next publish."""
        at = self.changed_at
        for i in changed:
            at[i] = version
        for i, a in enumerate(at):
            if a < 0:
                at[i] = base
        for leaf in self.leaves:
            leaf.dirty = True

    def close(self) -> None:
        """Stop tracking."""
        for leaf in self.leaves:
            self._untrack(leaf)

    # -- internal ----------------------------------------------------------------------------------
    def _look(self, source: list[torch.Tensor]) -> dict[int, list[tuple[int, int]] | None]:
        """The tracked leaves' written spans since their last look (None: unknown); a leaf whose
        memory moved since it was tracked is let go first, and answers nothing."""
        leaves, pages = self.leaves, self._pages
        if pages is None:
            return {}
        for leaf, t in zip(leaves, source):
            if leaf.tracked is not None and (t.data_ptr(), t.stride()) != leaf.where:
                self._untrack(leaf)
        ids = [i for i, leaf in enumerate(leaves) if leaf.tracked is not None]
        spans = pages.look([r for i in ids if (r := leaves[i].tracked) is not None]) if ids else []
        return dict(zip(ids, spans))

    def _track(self, source: list[torch.Tensor], moment: str) -> None:
        """Track, until the next look, the leaves not changing and the changing leaves whose
        stretch after this kind of moment was quiet last time; let the others go (a fault on every
        page an optimizer steps costs more than comparing the leaf)."""
        wanted = []
        for i, (leaf, t) in enumerate(zip(self.leaves, source)):
            keep = not leaf.changing or leaf.quiet_after.get(moment, False)
            if not keep:
                self._untrack(leaf)
            elif leaf.tracked is None and self.why_compared is None and leaf.untrackable != t.data_ptr():
                if _trackable(t):
                    wanted.append(i)
                else:
                    leaf.untrackable = t.data_ptr()  # compared while its memory stays where it is
        if not wanted:
            return
        if self._pages is None:
            try:
                self._pages = written_pages.for_this_process()
            except OSError as e:  # refused after all: every leaf is compared
                self.why_compared, self.proof = str(e), "comparison"
                return
        for i, tracked in zip(wanted, self._pages.track([_span_of(source[i]) for i in wanted])):
            if tracked.unknown is None:
                self.leaves[i].tracked, self.leaves[i].where = tracked, (source[i].data_ptr(), source[i].stride())

    def _untrack(self, leaf: _Leaf) -> None:
        if self._pages is not None and leaf.tracked is not None:
            self._pages.untrack([leaf.tracked])
        leaf.tracked = None


@dataclass(frozen=True)
class Delta:
    """What one version changed: the leaves whose bytes may differ from ``base``'s, the store's
    newest version right before ``version`` (every other leaf holds ``base``'s bytes exactly)."""

    version: int
    base: int
    leaves: tuple[int, ...]


def _spans_equal(source: torch.Tensor, held: torch.Tensor, spans: list[tuple[int, int]]) -> bool:
    """Whether the bytes of ``source`` on its written pages (``spans``: offsets into its memory)
    equal ``held``'s; past :data:`SPANS_COMPARED` bytes, or for a leaf not laid out plainly, it
    counts as changed (the caller copies it)."""
    if sum(n for _, n in spans) > SPANS_COMPARED or not (source.is_contiguous() and held.is_contiguous()):
        return False
    a, b = source.data_ptr(), held.data_ptr()
    return all(_memcmp(a + offset, b + offset, n) == 0 for offset, n in spans)
