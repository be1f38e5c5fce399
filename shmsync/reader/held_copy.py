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
a proof says that its bytes equal the slot's: the pages the kernel says were written since the
last reload (a tensor tracked from the moment a reload left it holding ``r``), or a comparison,
as :mod:`shmsync.store.changes` decides for a writer's source too. Only the pages a tensor fills
whole are tracked here, and its bytes on its first and last page are compared at every reload:
a reload copies the small and the changed tensors beside the large ones, and a tracked page they
share would fault on that copy and be protected again at the next reload.

Tensors smaller than :data:`~shmsync.store.changes.TRACK_MIN_BYTES` (biases, norms) are copied at
every reload, with no proof: copied together in one batch they cost less than a comparison each,
and they are a sliver of a model's bytes. A tensor that a reload copies is let go first (a copy
into a protected page costs a fault); one copied because it changed is changing, as a writer's
leaf would be.

A module on a GPU copies every tensor at every reload. The kernel cannot see writes to device
memory, and the only reference to compare with lies in host memory: a comparison would move the
same bytes over the bus as the copy it would save (or hold a second copy of the weights in device
memory). The device slots carry no records: a reader copying from them copies all too.

Why a reload holds exactly the version it says
----------------------------------------------
* The records read are the slot's own: they are read inside the copy, between the two loads of
  the slot's sequence number, and the writer writes them inside the write that changes the slot
  (:meth:`shmsync.writer.slot_copy.SlotCopy.copy_source`): a copy that validates read the
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

from shmsync.core.header import Proof
from shmsync.core.protocol import SlotReader
from shmsync.core.written_pages import Spans
from shmsync.store.changes import TRACK_MIN_BYTES, LeafWatch
from shmsync.store.copies import copy_all
from shmsync.store.memory import StoreMemory


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
        # A tied entry's target that is its owner's tensor too (the module ties them as well) is
        # loaded with it: once.
        tied, given = memory.layout.tied, dict(zip(indices, targets))
        keep = [k for k, i in enumerate(indices) if not _loaded_with(targets[k], given.get(tied.get(i, -1)))]
        targets, indices = [targets[k] for k in keep], [indices[k] for k in keep]
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
        # A reload writes the small and the changed tensors beside the tracked ones: their shared
        # pages are compared at each reload rather than tracked (no fault in each reload's copy).
        self.watch = LeafWatch(len(targets), edges_tracked=False)
        weakref.finalize(self, self.watch.close)

    @property
    def proof(self) -> Proof:
        """How the tensors a reload leaves as they are were proved unchanged (see
        :mod:`shmsync.store.changes`): :attr:`~Proof.WRITTEN_PAGES` (and comparison for those not
        tracked), :attr:`~Proof.COMPARISON` (write tracking unavailable here), or
        :attr:`~Proof.NONE` (a GPU module, or the device slots: every tensor copied)."""
        return Proof.NONE if self.records is None else self.watch.proof

    def load(self, slot_reader: SlotReader, timeout: float) -> int:
        """Load the newest complete version into the module through ``slot_reader`` (a seqlock
        copy, or a pinned one), copying only what it lacks; returns the version.

        Raises:
            ReloadTimeoutError: no copy validated within ``timeout`` seconds (the module's
                contents are then not known: the next reload copies everything).
        """
        held = self.version if self.records is not None else -1
        looked = self.watch.pages_written(self.targets) if held >= 0 else {}
        touched: set[int] = set()  # written by an attempt of this reload
        picked: list[int] = []
        copied = 0

        def copy(slot: int) -> None:
            nonlocal copied
            picked[:] = self._pick(slot, held, looked, touched)
            self.watch.let_go(picked)
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
            self._settle(set(picked), full=held < 0, looked=looked)
        return version

    def forget(self) -> None:
        """The module's contents are not known any more (it ran in place, or a reload failed):
        the next reload copies everything. Its tensors stop being tracked."""
        self.version = -1
        self.watch.close()

    def close(self) -> None:
        """Stop tracking the module's tensors (the reader is closed)."""
        self.forget()

    # -- internal ----------------------------------------------------------------------------------
    def _pick(self, slot: int, held: int, looked: dict[int, Spans], touched: set[int]) -> list[int]:
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
            if spans != []:  # not tracked (compared whole), or pages of it written since
                compare.append((i, views[index], spans))
        return picked + sorted(self.watch.differing(self.targets, compare))

    def _settle(self, picked: set[int], full: bool, looked: dict[int, Spans]) -> None:
        """After a reload that holds its version: which tensors are changing (copied because they
        changed, or written here), and tracking, until the next reload, the others that are not
        tracked yet."""
        changed = [i in picked and not full for i in range(len(self.targets))]
        self.watch.settle(self.targets, changed, "reload", looked, own=picked)


def _loaded_with(target: torch.Tensor, owner: torch.Tensor | None) -> bool:
    """Whether ``target`` is ``owner``'s memory (so loading the owner loads it)."""
    if owner is None:
        return False
    return target is owner or (
        target.device == owner.device and target.data_ptr() == owner.data_ptr() and target.stride() == owner.stride()
    )


__all__ = ["HeldCopy"]
