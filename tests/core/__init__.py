"""Tests of shmsync/core/: the torch-free memory protocol, its header, segments and fences, and the
protocol's exhaustive interleaving checker."""
