"""Which leaves changed, and which are tracked (shmsync/store/changes.py): a leaf written at every
look is never watched across its writes (no fault per page per optimizer step), whatever bytes it
writes; a leaf that stays as it is is watched, and proved unchanged without reading it; a write of
the same bytes is found equal; a leaf whose memory moved is let go and compared."""

import pytest
import torch

from shmsync.core.page_map import PAGE
from shmsync.core.written_pages import unavailable_reason
from shmsync.store.changes import COOL_AFTER, TRACK_MIN_BYTES, LeafWatch, same_bytes

needs_tracking = pytest.mark.skipif(unavailable_reason() is not None, reason="needs write tracking (Linux 6.7+)")
BIG = TRACK_MIN_BYTES // 4 * 4  # elements: 16 times the smallest leaf tracked


def _look(watch: LeafWatch, leaves: list[torch.Tensor], reference: list[torch.Tensor], moment: str = "publish"):
    """One look as a writer takes it: the written spans, a comparison of what they do not prove,
    the leaves found changed settled; returns them, the reference then made equal."""
    looked = watch.pages_written(leaves)
    which = [(i, reference[i], looked.get(i)) for i in range(len(leaves)) if looked.get(i) != []]
    changed = watch.differing(leaves, which)
    watch.settle(leaves, [i in changed for i in range(len(leaves))], moment, looked)
    for i in changed:
        reference[i].copy_(leaves[i])
    return changed


@needs_tracking
@pytest.mark.parametrize("same", [False, True], ids=["new values", "the same values"])
def test_a_leaf_written_at_every_look_is_not_tracked_across_its_writes(same):
    """An optimizer step writes the leaf between looks (with a zero gradient, Adam writes the same
    bytes): it is let go and stays so, so the step takes no fault (the same bytes, from the first
    look that saw it written); the leaf beside it, never written, is tracked from the first look
    on and proved unchanged by its pages."""
    stepped, frozen = torch.randn(BIG), torch.randn(BIG)
    leaves = [stepped, frozen]
    reference = [t.clone() for t in leaves]
    watch = LeafWatch(2)
    try:
        for k in range(6):
            with torch.no_grad():
                stepped.add_(0.0 if same else 1.0)  # in place, as an optimizer writes
            changed = _look(watch, leaves, reference)
            assert changed == (set() if same else {0}), f"look {k}"
            assert watch.tracked[1] is not None, f"look {k}: the frozen leaf is not tracked"
            if k:  # the same bytes: seen written from the second look on (nothing was known before the first)
                assert watch.tracked[0] is None, f"look {k}: the stepped leaf is tracked across its next write"
                assert watch.changing[0] and not watch.changing[1]
    finally:
        watch.close()


@needs_tracking
def test_a_leaf_that_stops_changing_is_tracked_again_after_quiet_looks():
    leaf = torch.randn(BIG)
    reference = [leaf.clone()]
    watch = LeafWatch(1)
    try:
        for _ in range(3):
            leaf.add_(1.0)
            _look(watch, [leaf], reference)
        assert watch.tracked[0] is None
        for _ in range(COOL_AFTER + 1):
            _look(watch, [leaf], reference)
        assert watch.tracked[0] is not None and not watch.changing[0]
    finally:
        watch.close()


@needs_tracking
@pytest.mark.parametrize("how", ["in place", ".data", "copy_ of the same bytes"])
def test_a_tracked_leaf_is_compared_where_written_and_found_as_it_is(how):
    """A write the version counter does not see (``.data``) is found by its pages; a write of the
    bytes it held is found equal, so nothing is copied."""
    leaf = torch.randn(BIG)
    reference = [leaf.clone()]
    watch = LeafWatch(1)
    try:
        for _ in range(2):
            _look(watch, [leaf], reference)
        assert watch.tracked[0] is not None
        if how == "in place":
            leaf[123] += 1.0
        elif how == ".data":
            leaf.data[123] += 1.0
        else:
            leaf.copy_(reference[0].clone())
        looked = watch.pages_written([leaf])
        assert looked[0], "the write's pages were not reported"
        found = watch.differing([leaf], [(0, reference[0], looked[0])])
        assert found == (set() if how == "copy_ of the same bytes" else {0})
    finally:
        watch.close()


@needs_tracking
def test_a_leaf_whose_memory_moved_is_let_go_and_compared():
    """``p.data = other``: the tracked pages are someone else's now; the look says nothing of the
    leaf, so the caller compares it whole."""
    param = torch.nn.Parameter(torch.randn(BIG))
    reference = [param.detach().clone()]
    watch = LeafWatch(1)
    try:
        for _ in range(2):
            _look(watch, [param], reference)
        assert watch.tracked[0] is not None
        param.data = torch.randn(BIG)
        assert watch.pages_written([param]) == {} and watch.tracked[0] is None
        assert watch.differing([param], [(0, reference[0], None)]) == {0}
    finally:
        watch.close()


def test_without_write_tracking_every_leaf_is_compared(monkeypatch):
    monkeypatch.setenv("SHMSYNC_WRITE_TRACKING", "0")
    leaf = torch.randn(BIG)
    reference = [leaf.clone()]
    watch = LeafWatch(1)
    for _ in range(3):
        assert _look(watch, [leaf], reference) == set()
    assert watch.tracked[0] is None and watch.proof == "comparison"
    leaf.data[5] = 1e9
    assert _look(watch, [leaf], reference) == {0}


def test_leaves_off_the_plain_layout_are_compared_as_integers():
    """Strided, on another dtype or device, ``-0.0`` against ``0.0``: compared bit for bit."""
    watch = LeafWatch(3)
    a = torch.arange(12.0).reshape(3, 4).t()
    b = a.contiguous()
    zero, negative = torch.tensor([0.0]), torch.tensor([-0.0])
    assert watch.differing([a, zero, zero], [(0, b, None), (1, negative, None), (2, zero.clone(), None)]) == {1}
    assert same_bytes(a, b) and not same_bytes(zero, negative)


@needs_tracking
@pytest.mark.parametrize("edges_tracked", [True, False], ids=["edges tracked", "edges compared"])
def test_neighbours_written_at_every_look_on_the_pages_a_leaf_shares(edges_tracked):
    """A leaf shares its first and last pages with neighbours written before every look (a reload's
    copy of the small tensors beside the large ones). Edges tracked: the neighbours' writes are
    reported there and the leaf's bytes on them compared. Edges compared: exactly those bytes are
    compared at every look, and no write of a neighbour is reported. Either way the leaf stays
    tracked and unchanged, and a write to its own bytes, on an edge page or between, is found."""
    floats_per_page = PAGE // 4
    block = torch.zeros(BIG + 4 * floats_per_page)
    # The leaf starts half way into a page, whatever the allocator's alignment.
    half = PAGE // 2
    start = (half - block.data_ptr() % PAGE) % PAGE // 4 + floats_per_page
    # Each through its own .data: three tensors, as a module's are, each with its own version counter.
    before, leaf, after = block.data[:start], block.data[start : start + BIG], block.data[start + BIG :]
    nbytes = leaf.nbytes
    assert leaf.data_ptr() % PAGE == half
    reference = [leaf.clone()]
    watch = LeafWatch(1, edges_tracked=edges_tracked)
    try:
        for k in range(4):
            before[-1] += 1.0
            after[0] += 1.0
            looked = watch.pages_written([leaf])
            if k >= 1:  # tracked since the first look
                if edges_tracked:  # the two shared pages, written by the neighbours: its bytes on them
                    assert looked[0] == [(0, half), (nbytes - half, half)], f"look {k}"
                else:  # its bytes on them, compared although no write was reported
                    assert looked[0] == watch.edges[0] == [(0, half), (nbytes - half, half)], f"look {k}"
                assert watch.inside(0, looked[0]) == edges_tracked, f"look {k}: {looked[0]}"
            changed = watch.differing([leaf], [(0, reference[0], looked.get(0))])
            assert changed == set(), f"look {k}"
            watch.settle([leaf], [False], "publish", looked)
            assert watch.tracked[0] is not None, f"look {k}: the leaf is not tracked"
        for element in (0, BIG // 2, BIG - 1):  # on its first page, on one it fills, on its last page
            leaf.data[element] += 1.0  # through .data: torch's version counter does not move
            looked = watch.pages_written([leaf])
            assert 0 in looked, f"element {element}: the leaf was let go"
            assert watch.differing([leaf], [(0, reference[0], looked[0])]) == {0}, f"element {element}"
            leaf.data[element] -= 1.0
    finally:
        watch.close()
