"""Page-locking host memory for CUDA copies (two cudart calls), below the store's memory.

The first time a process copies between a store and a CUDA device, the store's slots are
registered as page-locked memory (``cudaHostRegister``), so both directions are asynchronous
DMA on the copy engines. They are unregistered before the mapping goes.
"""

from __future__ import annotations

import torch


def register_host(tensor: torch.Tensor) -> int:
    """Page-lock the memory behind a CPU tensor; returns its pointer for :func:`unregister_host`."""
    ptr, size = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {size} bytes failed with CUDA error {int(err)}")
    return ptr


def unregister_host(ptr: int) -> None:
    """Undo :func:`register_host` (before the memory is unmapped)."""
    torch.cuda.cudart().cudaHostUnregister(ptr)
