"""Tests of shmsync/watch/: the stale-reader alarm and the versions frames carry."""
