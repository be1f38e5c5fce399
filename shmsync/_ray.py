"""shmsync as each remote collector's local leg under TorchRL's ``RayCollector`` (torchrl 0.14).

``RayCollector`` pushes the trainer's weights to one Ray actor per remote collector with a
``RayWeightSyncScheme``; each actor's collector hands them on to its workers through the scheme
in ``collector_kwargs["weight_sync_schemes"]``. TorchRL's scheme can carry a version with each
push (``model_version``), which the actor's collector learns right after the push's weights have
reached its own scheme (``_set_received_policy_version``). With a
:class:`~shmsync.ShmWeightSyncScheme` there:

- **Trainer**: the Ray scheme counts its pushes and gives each one its count as
  ``model_version``: the version is the trainer's, whichever actors a push reaches
  (``RayCollector(sync=False)`` updates only the actor that delivered).
- **Actor**: the weights of a push are staged when they reach the local scheme and published
  under the push's ``model_version`` once the actor's collector learns it (see
  :class:`shmsync._scheme_sender.SenderGroup`); a push whose version never comes is published
  under the next version after a moment, with a warning, rather than held back.

A collector without a shmsync scheme in its ``collector_kwargs`` runs TorchRL's code unchanged.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from . import _torchrl_compat as compat
from ._distributed import local_schemes

SEND = "RayWeightSyncScheme.send, wrapped, and RayWeightSyncScheme._set_model_version"
_PUSHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # the trainer's Ray scheme -> its pushes


def _feeds_shmsync(scheme: Any) -> bool:
    """Whether ``scheme`` (the trainer's Ray scheme) pushes to actors whose local leg is shmsync."""
    context = getattr(scheme, "context", None)
    return bool(local_schemes(getattr(context, "collector_kwargs", None)))


def patch_scheme_module(module: Any) -> None:
    """``torchrl.weight_update._ray`` was imported: the trainer's Ray scheme counts its pushes."""
    cls = getattr(module, "RayWeightSyncScheme", None)
    if not isinstance(cls, type) or getattr(cls.send, "_shmsync", False):
        return
    original = cls.send

    @functools.wraps(original)
    def send(self: Any, weights: Any = None, worker_ids: Any = None) -> Any:
        if _feeds_shmsync(self):
            set_version = getattr(self, "_set_model_version", None)
            compat.check(SEND, callable(set_version), f"{type(self).__name__} has no _set_model_version")
            count = _PUSHES.get(self, 0) + 1
            _PUSHES[self] = count
            set_version(count)
        return original(self, weights, worker_ids)

    send._shmsync = True
    cls.send = send


def is_ray_actor_collector(collector: Any) -> bool:
    """Whether ``collector`` receives the trainer's weights through TorchRL's Ray scheme (and so
    learns each push's version after its weights reached the local scheme)."""
    receivers = compat.receiver_schemes(collector)
    ray = any(any(k.__name__ == "RayWeightSyncScheme" for k in type(s).__mro__) for s in receivers.values())
    return ray and compat.takes_received_version(collector)
