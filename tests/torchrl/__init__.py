"""Tests of shmsync/torchrl/: the scheme, the hook and the TorchRL boundary, on real collectors."""
