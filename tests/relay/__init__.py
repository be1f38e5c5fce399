"""Tests of shmsync/relay/: the wire, sealing and relay trees on loopback."""
