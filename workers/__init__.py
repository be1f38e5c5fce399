"""Standalone rollout worker processes built on shmsync.

:func:`shmsync.workers.launch.launch` starts N collector processes that attach to a trainer's
:class:`~shmsync.WeightStore` by name, run a TorchRL collector with a
:class:`~shmsync.WeightReader`, reload lazily and hand their batches back through a queue.
"""
