"""Tests of shmsync/store/: what the writer's and the reader's sides share."""
