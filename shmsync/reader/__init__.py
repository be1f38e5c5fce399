"""The reader's side: checking a store's version and loading it, in place or as a copy."""
