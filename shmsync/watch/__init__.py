"""The operators' view: the readers' table on every host, the stale-reader alarm, frames' versions."""
