"""Every Python block of the README and of docs/, run as pasted."""
