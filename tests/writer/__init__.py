"""Tests of shmsync/writer/: the weight store and publishing, on the CPU and from CUDA."""
