"""A copying reader reloads what changed: after every way the trainer changes its weights it holds
the trainer's bytes exactly, and after every way its own process writes its module it gets the
store's bytes back at its next reload; the bytes it copies are in proportion to what changed; a
copy that failed validation leaves nothing behind; under both proofs (the pages written, and
comparison where write tracking is off), across real processes too."""

import pytest
import torch

from shmsync import WeightReader, WeightStore
from shmsync.core import written_pages
from shmsync.reader.held_copy import HeldCopy
from shmsync.store.changes import TRACK_MIN_BYTES, same_bytes
from shmsync.testing import hold_table_lock
from tests.processes import follow_copying
from tests.routes import ROUTES, Policy, write
from tests.weights import ParamBlob

PROOFS = ["written pages", "comparison"]
TRACKING = written_pages.unavailable_reason() is None


@pytest.fixture(params=PROOFS)
def proof(request, monkeypatch):
    """Each test under each proof of the reader's module: the pages written (where write tracking
    is available: Linux 6.7+), and comparison (SHMSYNC_WRITE_TRACKING=0)."""
    if request.param == "comparison":
        monkeypatch.setenv("SHMSYNC_WRITE_TRACKING", "0")
    elif not TRACKING:
        pytest.skip(f"write tracking is unavailable here: {written_pages.unavailable_reason()}")
    return request.param


def nbytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def assert_holds(reader: WeightReader, source: torch.nn.Module, what: str) -> None:
    """The reader's module holds ``source``'s bytes, every one of them."""
    want = {name: t.detach() for name, t in source.state_dict().items()}
    for name, t in reader.module.state_dict().items():
        assert same_bytes(t, want[name].contiguous()), f"{what}: {name} differs"


def publish_head(store: WeightStore, policy: Policy) -> None:
    """A step of training: only the head changes."""
    with torch.no_grad():
        policy.head.weight.add_(1.0)
    store.publish(policy)


@pytest.mark.parametrize("how", ROUTES)
def test_after_every_route_of_change_on_the_trainer_a_copying_reader_holds_its_bytes(store_factory, proof, how):
    """The head changes at every publish, the backbone only through ``how``, once a round: the
    reader copies the backbone at the reload after it changed, and only what changed after that."""
    torch.manual_seed(0)
    policy = Policy()
    store = store_factory(policy, num_slots=2)
    reader = WeightReader(store, Policy(), zero_copy=False)
    assert reader.poll() and reader.copied_bytes == nbytes(policy)  # the first load: everything
    backbone = nbytes(policy.backbone)
    for k in range(1, 4):
        write(policy, how, float(k))
        for n in range(3):
            publish_head(store, policy)
            assert reader.poll()
            assert_holds(reader, policy, f"{how}, round {k}, publish {n}")
            copied = reader.copied_bytes
            assert copied + reader.skipped_bytes == nbytes(policy)
            if n > 0:  # the head changed, and nothing else
                assert copied < backbone, f"{how}, round {k}: {copied} bytes copied"
            elif how != "buffer in forward":  # the backbone changed too
                assert copied > backbone, f"{how}, round {k}: {copied} bytes copied"
    assert reader.unchanged_proof == proof


@pytest.mark.parametrize("how", ROUTES)
def test_a_module_its_own_process_wrote_gets_the_stores_bytes_back_at_its_next_reload(store_factory, proof, how):
    """The reader's process writes its module by ``how`` (TorchRL's load_state_dict in a worker, a
    user's code, an optimizer, a forward pass in training mode, ...): the next reload copies what
    was written back, and nothing else."""
    torch.manual_seed(0)
    policy = Policy()
    store = store_factory(policy, num_slots=3)
    reader = WeightReader(store, Policy(), zero_copy=False)
    reader.poll()
    publish_head(store, policy)
    reader.poll()
    for k in range(1, 4):
        write(reader.module, how, float(k))
        publish_head(store, policy)
        assert reader.poll()
        assert_holds(reader, policy, f"{how}, round {k}")
        if how != "buffer in forward":
            assert reader.copied_bytes > 4 * policy.head.weight.numel(), f"{how}: not copied back"
        publish_head(store, policy)
        assert reader.poll()
        assert_holds(reader, policy, f"{how}, round {k}, once more")
        assert reader.copied_bytes < nbytes(policy.backbone), f"{how}, round {k}: {reader.copied_bytes} bytes copied"


class Frozen(torch.nn.Module):
    """A frozen 32 MB backbone and a trained 1 MB head."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Linear(2048, 4096)
        self.head = torch.nn.Linear(512, 512)
        self.backbone.requires_grad_(False)


def test_a_reload_after_a_publish_of_the_head_copies_the_head(store_factory, proof):
    """32 MB frozen and 1 MB trained: a reload after a publish where only the head changed copies
    the head (and the biases, too small to be worth a proof), and the readers' table says so."""
    torch.manual_seed(0)
    policy = Frozen()
    store = store_factory(policy)
    reader = WeightReader(store, Frozen(), zero_copy=False)
    reader.poll()
    head = policy.head.weight.numel() * 4
    small = sum(t.numel() * 4 for t in policy.state_dict().values() if t.numel() * 4 < TRACK_MIN_BYTES)
    assert small == (4096 + 512) * 4  # the biases: copied at every reload, with no proof
    for _ in range(3):
        publish_head(store, policy)
        assert reader.poll()
        assert_holds(reader, policy, "a publish of the head")
        assert reader.copied_bytes == head + small, reader.copied_bytes
        assert reader.skipped_bytes == nbytes(policy) - head - small
        (row,) = store.readers(processes=False)
        assert row.copied_bytes == head + small and row.mode == "copy"


def test_a_copy_that_failed_validation_is_copied_again_whatever_the_records_of_the_next(store_factory, proof):
    """An attempt that copied from a slot being rewritten (its record said changed, its bytes torn)
    and failed validation: the next attempt copies that tensor again, though the slot it reads
    then says it did not change since the version the module held."""
    sizes = {"big": 1 << 16, "small": 8}  # 256 KiB: tracked where it can be
    source = ParamBlob(sizes)
    store = store_factory(source, num_slots=2)
    module = ParamBlob(sizes)
    memory = store.memory
    held = HeldCopy(memory, list(module.parameters()), [0, 1], memory.read_slots(), records=True)
    assert held.load(store.slot_reader, 10.0) == 0
    with torch.no_grad():
        source.small.fill_(1.0)  # only the small one changes
    store.publish(source)
    slot = memory.host.h[memory.host.latest]
    views, records = memory.map_slots()[slot], memory.records

    class TornThenWhole:
        """Attempt 1: the slot read as if the writer were rewriting it (a newer record, other
        bytes); it fails validation. Attempt 2: the slot as it is."""

        def read(self, copy, timeout):
            was = records[slot * 2]
            records[slot * 2] = 5
            views[0].fill_(7.0)
            copy(slot)  # a copy the sequence number then refuses
            records[slot * 2] = was
            views[0].fill_(0.0)
            copy(slot)
            return 1

    assert held.load(TornThenWhole(), 10.0) == 1
    assert (module.big == 0.0).all() and (module.small == 1.0).all()
    assert held.copied_bytes == 2 * sizes["big"] * 4 + 2 * sizes["small"] * 4  # big twice, small twice


def test_a_reader_back_from_running_in_place_copies_everything(store_factory, proof):
    policy = Frozen()
    store = store_factory(policy)
    reader = WeightReader(store, Frozen(), zero_copy=True)
    assert reader.poll() and reader.viewing and reader.copied_bytes == 0  # in place: no buffer to copy
    publish_head(store, policy)
    other = WeightStore.attach(store.name)  # its table lock conflicts with the reader's
    try:
        with hold_table_lock(other):
            assert reader.poll() and not reader.viewing  # no lease: a copy
    finally:
        other.close()
    assert reader.copied_bytes == nbytes(policy)
    assert_holds(reader, policy, "back from in place")


def test_what_a_reader_copies_from_where_it_cannot_prove(store_factory, monkeypatch):
    """Tensors in shared memory are compared (the kernel does not see others' writes to them), and
    without write tracking everything is: the proof the reader names."""
    policy = Frozen()
    store = store_factory(policy)
    module = Frozen()
    module.share_memory()
    reader = WeightReader(store, module, zero_copy=False)
    reader.poll()
    module.backbone.weight.data[0, 0] = 5.0
    publish_head(store, policy)
    assert reader.poll() and reader.copied_bytes > nbytes(policy.backbone)  # found by comparison
    assert_holds(reader, policy, "shared memory")
    monkeypatch.setenv("SHMSYNC_WRITE_TRACKING", "0")
    reader = WeightReader(store, Frozen(), zero_copy=False)
    reader.poll()
    assert reader.unchanged_proof == "comparison"


@pytest.mark.slow
@pytest.mark.cuda
def test_a_gpu_module_copies_every_tensor(store_factory):
    """A GPU module loading from the host slots copies all of it at every reload: no proof on the
    device costs less than the copy."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    policy = Frozen()
    store = store_factory(policy)
    reader = WeightReader(store, Frozen().cuda(), zero_copy=False)
    reader.poll()
    publish_head(store, policy)
    assert reader.poll() and reader.copied_bytes == nbytes(policy)
    assert reader.unchanged_proof == "none: every leaf copied"
    for name, t in reader.module.state_dict().items():
        assert torch.equal(t.cpu(), policy.state_dict()[name]), name


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_copying_reader_in_another_process_copies_what_changed(store_factory, start, proof):
    """A child process follows the versions with a private copy: each holds the trainer's values;
    it copies the head at each reload, the backbone only at the reload after the trainer changed
    it, and at the one after its own process wrote it."""
    sizes = {"backbone": 1 << 20, "head": 1 << 14}  # 4 MiB, 64 KiB
    source = ParamBlob(sizes)
    store = store_factory(source)
    child = start(follow_copying, store, sizes, 8, 3, proof == "written pages")
    child.expect("ready")
    for version in range(1, 9):
        child.expect("loaded")  # the version before: the child sees every one
        with torch.no_grad():
            source.head.fill_(float(version))
            if version == 6:
                source.backbone.fill_(6.0)
        assert store.publish(source) == version
    child.expect("loaded")
    seen, child_proof = child.expect("seen")
    assert child_proof == proof
    assert [v for v, _, _ in seen] == list(range(9))
    head, backbone = 4 * sizes["head"], 4 * sizes["backbone"]
    for version, values, copied in seen:
        assert values == {"backbone": 6.0 if version >= 6 else 0.0, "head": float(version)}, version
        # the first load; after its own write (at version 3); after the trainer's (version 6)
        want = head + backbone if version in (0, 4, 6) else head
        assert copied == want, (version, copied)
