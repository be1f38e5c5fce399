"""shmsync's tests, laid out like the package: tests/core/ tests shmsync/core/, and so on
(docs/testing.md)."""
