"""GPU readers in processes of their own (``tests/writer/test_cuda.py``)."""

from __future__ import annotations

import torch

from shmsync import WeightReader, WeightStore


def cuda_layers():
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))


def cuda_reader(name: str, device: str, versions: int, options: dict, conn) -> None:
    """A reader of store ``name`` in its own process, its module on ``device`` (``"cpu"`` too):
    for each version 1..``versions`` it waits for it and reports whether every weight holds that
    version's number, whether its parameters view shared memory, and the memory it holds itself."""

    store = WeightStore.attach(name)
    module = cuda_layers().to(device)
    reader = WeightReader(store, module, **options)
    reader.poll()
    conn.send(("ready", reader.viewing))
    for version in range(1, versions + 1):
        reader.wait(version, timeout=60)
        values = {float(v) for p in module.parameters() for v in p.detach().unique().cpu()}
        conn.send(("loaded", reader.version, values == {float(reader.version)}, reader.viewing))
    conn.recv()  # the parent has read the readers' table
    reader.close()
    store.close()
