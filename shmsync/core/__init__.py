"""The memory core: a store's file and its kernel locks, its header and tensor layout, the slot
protocol between one writer and many readers, fences and copies. Nothing here knows TorchRL;
the header, segment, protocol and fences do not import torch."""
