"""The writer's side: a store and publishing into it (from the CPU, in the background, from CUDA)."""
