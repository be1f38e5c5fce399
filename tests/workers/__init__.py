"""Tests of shmsync.workers (workers/): standalone rollout workers and the relay command."""
