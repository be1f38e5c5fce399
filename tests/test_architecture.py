"""The path of one publish, as docs/architecture.md draws it, is the path the code takes.

A steady-state ``update_policy_weights_()`` of a ``MultiSyncCollector`` (2 CPU workers, the default
scheme) with the next batch's hand-out that publishes it, and a CPU reader's ``poll()`` that loads a
version are traced (``sys.setprofile``: every shmsync function called, comprehensions and lambdas
aside); the distinct functions, in the order first called, must be the page's, no more than the
page counts (the trainer's 48 in 15 files: the update noted, the hand-out, the source matched, what
changed found by the pages written and a comparison, the copy and the commit; the worker's 12 in
5), and no two of one name.
"""

import json
import mmap
import os
import re
import sys
import threading
from types import CodeType, FunctionType

import pytest
import torch

import shmsync
from shmsync import WeightReader, WeightStore
from tests.commands import CHECKOUT, python, run_command, with_tests_importable

ROOT = CHECKOUT
PACKAGE = os.path.dirname(shmsync.__file__)
DOC = ROOT / "docs" / "architecture.md"


def documented(block: str, taken: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """The ``(file, function)`` lines of the path block headed ``block`` in docs/architecture.md.

    A line whose note begins ``(only while`` is a step the code takes or not with what other
    processes did meanwhile (a worker that has not yet moved on): it is kept where ``taken``, the
    path the code took, has it, and left out where it does not."""
    text = DOC.read_text()
    start = text.index(f"path: {block}")
    body = text[start : text.index("```", start)]
    lines = re.findall(r"^\s+(\S+\.py)\s+([\w.<>]+)[ \t]*(.*)$", body, re.M)
    return [(f, fn) for f, fn, note in lines if not note.startswith("(only while") or (f, fn) in (taken or [])]


def qualified_names() -> dict[CodeType, str]:
    """Every function of the shmsync modules imported so far, by its code, with its qualified name
    (``Publisher.route``, ``outer.<locals>.inner``): what ``code.co_qualname`` says on Python 3.11
    and later, found from the modules' classes and functions so that the test runs on 3.10 too."""
    names: dict[CodeType, str] = {}

    def code(c: CodeType, qualname: str) -> None:
        if c not in names:
            names[c] = qualname
            for const in c.co_consts:
                if isinstance(const, CodeType):
                    code(const, f"{qualname}.<locals>.{const.co_name}")

    def members(namespace: object, seen: set[int]) -> None:
        for value in vars(namespace).values():
            for fn in (value, *(getattr(value, a, None) for a in ("__func__", "fget", "fset", "func"))):
                # A wrapper made with functools.wraps carries the wrapped function's names (its
                # own code is found where it is defined, a decorator's <locals>); the wrapped
                # function is its __wrapped__ (a context manager's generator).
                for _ in range(8):  # wrappers of wrappers, not a chain without end
                    if isinstance(fn, FunctionType) and fn.__name__ == fn.__code__.co_name:
                        code(fn.__code__, fn.__qualname__)
                    fn = getattr(fn, "__wrapped__", None)
                    if fn is None:
                        break
            if isinstance(value, type) and value.__module__.startswith("shmsync") and id(value) not in seen:
                seen.add(id(value))
                members(value, seen)

    seen: set[int] = set()
    for name, module in list(sys.modules.items()):
        if name == "shmsync" or name.startswith("shmsync."):
            members(module, seen)
    return names


class Tracer:
    """Records the shmsync functions called, per thread, while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.calls: dict[str, list[CodeType]] = {}

    def __call__(self, frame, event, arg):
        if event == "call" and self.on:
            code = frame.f_code
            if code.co_filename.startswith(PACKAGE) and not code.co_name.startswith("<"):
                self.calls.setdefault(threading.current_thread().name, []).append(code)

    def path(self, thread: str) -> list[tuple[str, str]]:
        names = qualified_names()
        calls = dict.fromkeys(self.calls.get(thread, []))
        return [(os.path.relpath(c.co_filename, PACKAGE), names.get(c, c.co_name)) for c in calls]


def check_walk(path: list[tuple[str, str]], most_functions: int, most_files: int) -> None:
    """At most so many functions in so many files, and no two of them of one name: each hop says
    what it does (``Publisher.route``, ``StoreWriter.write``), so a stack trace reads as a sentence."""
    files = {f for f, _ in path}
    assert len(path) <= most_functions and len(files) <= most_files, (
        f"{len(path)} functions in {len(files)} files: {path}"
    )
    names = [qualname.rpartition(".")[2] for _, qualname in path]
    assert len(set(names)) == len(names), f"functions of one name on the path: {names}"


def test_a_cpu_readers_load_takes_the_documented_path():
    policy = torch.nn.Linear(64, 64)
    with WeightStore.create(policy) as store:
        reader = WeightReader(store, torch.nn.Linear(64, 64))
        reader.poll()
        store.publish(policy)
        reader.poll()
        store.publish(policy)
        tracer = Tracer()
        sys.setprofile(tracer)
        tracer.on = True
        try:
            assert reader.poll()
        finally:
            tracer.on = False
            sys.setprofile(None)
        reader.close()
    path = tracer.path(threading.current_thread().name)
    assert path == documented("worker"), f"the code took:\n{path}"
    check_walk(path, 12, 5)  # when (poll, reload), then how (_load): in place or a copy


def trace_one_update() -> dict[str, list[tuple[str, str]]]:
    """One update published by a ``MultiSyncCollector``'s hand-out, traced: the functions the
    trainer's thread and the store's copier thread called, by thread."""
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import MultiSyncCollector
    from torchrl.modules import MLP

    from tests.torchrl.collectors import make_pendulum

    net = MLP(in_features=3, out_features=1, num_cells=[256, 256])
    # The weights in one block of memory of their own (past the C library's heap: mapped alone),
    # so that no other object of the process writes their pages: the steady state the path is of.
    # The parameters start 64 bytes into a page, wherever the allocator put the block: the frozen
    # 256x256 layer then ends inside a page that the stepped head shares, as the page draws it.
    block = torch.zeros(9 << 20)
    with torch.no_grad():
        start = (64 - block.data_ptr()) % mmap.PAGESIZE // block.element_size()
        for p in net.parameters():
            p.data = block[start : start + p.numel()].view_as(p).copy_(p)
            start += p.numel()
    policy = TensorDictModule(net, in_keys=["observation"], out_keys=["action"])
    scheme = shmsync.ShmWeightSyncScheme()
    tracer = Tracer()
    threading.setprofile(tracer)  # the store's copier thread starts at the first update: traced too
    collector = MultiSyncCollector(
        [make_pendulum] * 2, policy, frames_per_batch=64, total_frames=-1, weight_sync_schemes={"policy": scheme}
    )
    head = net[-1].weight  # trained at every batch; the layers before it stay as they are (frozen)
    try:
        it = iter(collector)
        for _ in range(4):  # steady state: every slot written, the workers leasing, the frozen layers tracked
            next(it)
            with torch.no_grad():
                head.add_(1.0)
            collector.update_policy_weights_()
        next(it)
        with torch.no_grad():
            head.add_(1.0)
        sys.setprofile(tracer)
        tracer.on = True
        collector.update_policy_weights_()  # noted for the hand-out...
        next(it)  # ...which publishes it, as the next batch is handed out
        sys.setprofile(None)
        scheme.store.flush(timeout=30)  # the give-backs, still traced on the copier's thread
        tracer.on = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        collector.shutdown()
    return {
        "trainer": tracer.path(threading.current_thread().name),
        "copier": tracer.path(f"shmsync-publish-{scheme.store.name}"),
    }


@pytest.mark.slow
@pytest.mark.torchrl
@pytest.mark.timeout(180)
def test_one_update_takes_the_documented_path():
    # In a process of its own: a thread that an earlier test in this process left running would
    # count as one that may write the weights, and the copy would then be checked after it (a
    # longer path, the right one for such a process, not the one documented).
    run = run_command(python("-c", TRACE), env=with_tests_importable(), check=True, timeout=150)
    paths = {thread: [tuple(step) for step in path] for thread, path in json.loads(run.stdout.splitlines()[-1]).items()}
    trainer, copier = paths["trainer"], paths["copier"]
    assert trainer == documented("trainer"), f"the trainer's thread took:\n{trainer}"
    assert copier == documented("copier", copier), f"the copier's thread took:\n{copier}"
    check_walk(trainer, 48, 15)


TRACE = "import json; from tests.test_architecture import trace_one_update; print(json.dumps(trace_one_update()))"
