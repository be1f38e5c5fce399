"""Which TorchRL releases shmsync supports, told from a version string alone (TorchRL is not
imported here: ``shmsync.torchrl.compat`` gates the installed release with the string it reads).

Releases 0.11 to 0.14 are each tested by ``make test``. TorchRL's next minor, 0.15, is tested
ahead of its release through ``torchrl-nightly``: ``make test-full``'s nightly leg installs the
nightly named by :data:`NIGHTLY` (the Makefile reads it from this file: the one place it is
written), and a nightly of that date or later counts as 0.15. A nightly's version is its build
date (``2026.10.27``), the distribution ``torchrl-nightly``.
"""

from __future__ import annotations

import re

SUPPORTED = ((0, 11), (0, 15))  # first and last minor the gate lets in
NEWEST_RELEASE = (0, 14)  # the newest minor released: the main tier runs on it
NIGHTLY = "2026.10.27"  # the torchrl-nightly make test-full installs and runs (bump it here alone)
NIGHTLY_MINOR = (0, 15)  # the minor a nightly of that date or later is heading for


def _numbers(version: str) -> tuple[int, ...]:
    """The leading numbers of ``version`` ("0.15.0rc1+cpu" -> (0, 15, 0)), each at most 9 digits."""
    numbers = []
    for part in version.split("+")[0].split("."):
        digits = re.match(r"\d{1,9}", part)
        if digits is None:
            break
        numbers.append(int(digits.group()))
        if digits.end() < len(part):
            break
    return tuple(numbers)


NIGHTLY_TESTED = _numbers(NIGHTLY)  # (2026, 10, 27)


def is_nightly(version: str) -> bool:
    """Whether ``version`` is a nightly's: a build date, ``YYYY.MM.DD``."""
    numbers = _numbers(version)
    return len(numbers) >= 3 and numbers[0] >= 2000


def minor(version: str) -> tuple[int, int] | None:
    """The minor ``version`` counts as: ``(0, 14)`` for ``"0.14.1"``, :data:`NIGHTLY_MINOR` for a
    nightly of :data:`NIGHTLY_TESTED` or later, None for an older nightly or an unreadable string.

    Examples:
        >>> minor("0.14.1"), minor("0.15.0rc1"), minor("2026.10.27"), minor("2026.9.1"), minor("?")
        ((0, 14), (0, 15), (0, 15), None, None)
    """
    numbers = _numbers(version)
    if is_nightly(version):
        return NIGHTLY_MINOR if numbers[:3] >= NIGHTLY_TESTED else None
    return (numbers[0], numbers[1]) if len(numbers) >= 2 else None


def refusal(version: str) -> str | None:
    """Why shmsync does not run with torchrl ``version``, with what to install instead; None when
    it does.

    Examples:
        >>> refusal("0.14.1") is None, refusal("2026.10.27") is None
        (True, True)
        >>> print(refusal("0.16.0"))  # doctest: +ELLIPSIS
        shmsync supports torchrl 0.11 to 0.15 ... this is torchrl 0.16.0. Install ...
    """
    first, last = (".".join(map(str, v)) for v in SUPPORTED)
    found = minor(version)
    if found is not None and SUPPORTED[0] <= found <= SUPPORTED[1]:
        return None
    why = f"shmsync supports torchrl {first} to {last} (and torchrl-nightly from {NIGHTLY}); this is torchrl {version}."
    if is_nightly(version):
        return f"{why} Update the nightly (pip install -U torchrl-nightly tensordict-nightly), or install a release"
    return (
        f"{why} Install a torchrl in that range (pip install 'torchrl>={first},<{SUPPORTED[1][0]}."
        f"{SUPPORTED[1][1] + 1}'), or a shmsync that supports it"
    )
