"""Tests of shmsync/reader/: WeightReader, in place and as a private copy."""
