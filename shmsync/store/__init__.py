"""What the writer's and the reader's sides share: a store's memory as mapped in a process, its
tensor layout, the copies into and out of a slot, what users pass as weights, the records of its
device slots, and the readers' table read from its header."""
