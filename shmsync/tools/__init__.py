"""Operators' tools: the ``shmsync`` command (``ls``, ``gc``, ``new-secret``) and the host-wide
view of stores it reads without attaching to any."""
