"""What a user asks of a :class:`~shmsync.ShmWeightSyncScheme`, checked once: the settings its
trainer's side (:mod:`shmsync.torchrl.publisher`) and its workers' (:mod:`shmsync.torchrl.receiver`)
read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from shmsync.errors import ArgumentTypeError, InvalidArgumentError
from shmsync.watch.alarm import check_settings


@dataclass
class SchemeSettings:
    """One scheme's settings (see :class:`~shmsync.ShmWeightSyncScheme` for each).

    ``per_worker_weights`` may turn on once a collector shows distinct weights per worker (a list of
    distinct ``policy_factory``): the trainer's side tells the scheme, which sets it here.

    Examples:
        >>> SchemeSettings(num_slots=5).num_slots
        5
        >>> SchemeSettings(poll_every_steps=0)
        Traceback (most recent call last):
        ...
        shmsync.errors.InvalidArgumentError: poll_every_steps must be >= 1 or None, got 0
    """

    poll_every_steps: int | None = None
    version_key: str | None = "policy_version"
    num_slots: int = 4
    zero_copy: bool | None = None
    unsafe_background_copy: bool = False
    source: nn.Module | None = None
    per_worker_weights: bool = False
    alarm: dict[str, Any] | None = None  # the stale-worker alarm's (stale_after, max_lag, on_stale), or None

    def __post_init__(self) -> None:
        if self.source is not None and not isinstance(self.source, nn.Module):
            raise ArgumentTypeError(f"source must be an nn.Module, got {type(self.source).__name__}")
        if self.poll_every_steps is not None and self.poll_every_steps < 1:
            raise InvalidArgumentError(f"poll_every_steps must be >= 1 or None, got {self.poll_every_steps}")
        if self.alarm is not None:
            check_settings(self.alarm["stale_after"], self.alarm["max_lag"], self.alarm["on_stale"])

    @staticmethod
    def alarm_of(stale_after: float | None, max_lag: int | None, on_stale: str | Callable | None) -> dict | None:
        """The alarm's settings, or None for no alarm (``on_stale=None``)."""
        return None if on_stale is None else {"stale_after": stale_after, "max_lag": max_lag, "on_stale": on_stale}
