"""Tests of shmsync/tools/: the shmsync command and the host's stores."""
