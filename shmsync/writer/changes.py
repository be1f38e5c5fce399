"""Whether a source's tensors hold the bytes of a slot, leaf by leaf: the proof a publish needs
before it skips a leaf, or before it skips a whole version because nothing changed.

A leaf is *unchanged* only when every byte of it equals the slot's: compared as the integers of
its element size, so that ``-0.0`` and ``0.0``, or two NaNs of different payloads, count as
different (a reader must get the source's bytes, not an equal value). What cannot be compared
that way (a slot on another device than the source) counts as changed.

A copy made while another thread may write the source is checked the same way once it is done
(:func:`same_as`): every leaf compared after every leaf was copied. If each leaf still holds the
bytes it was copied with, no write reached any leaf between its copy and its comparison, and all
those windows contain the moment between the last copy and the first comparison: the slot holds
the source's memory as it was at that moment. The one write this cannot see is one that changes
a leaf and puts its exact bytes back within that window. What no copy can tell is where another
thread stands in a write of its own: one that sat between two tensors of an optimizer step for
the whole window is caught there, one tensor stepped and the other not. That is why a
collector's hand-out publishes again only updates made by the thread that iterates it
(:meth:`shmsync.torchrl.publishing.Publisher.hand_out`).
"""

from __future__ import annotations

import torch

# The integer type of each element size: a leaf's bytes compared as integers of its own width.
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
    a, b = _as_ints(source), _as_ints(held)
    return a is not None and b is not None and torch.equal(a, b)


def changed_leaves(sources: list[torch.Tensor], held: list[torch.Tensor]) -> list[bool]:
    """Per leaf, whether ``sources[i]`` differs from ``held[i]`` (a slot's view) in any byte."""
    return [not same_bytes(s, h) for s, h in zip(sources, held)]


def same_as(sources: list[torch.Tensor], held: list[torch.Tensor]) -> bool:
    """Whether every source leaf still holds the bytes of ``held``: after a copy into ``held``,
    that the copy is one state of the source (see the module's docstring)."""
    return all(same_bytes(s, h) for s, h in zip(sources, held))
