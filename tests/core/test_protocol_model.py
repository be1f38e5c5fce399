"""The model the interleaving checker explores (tests/core/protocol_model.py) follows the code
(shmsync/core/protocol.py): run one operation at a time from the same header, each party of the model
makes the same stores, fences and lock operations, and the same loads of words another party
writes, in the same order, with the same values, and leaves the same words behind. With records,
the model's writer leaves in each slot the leaves and records a real store's publishes leave
(shmsync/writer/store.py), and its reader copies the leaves a real copying reader copies
(shmsync/reader/held_copy.py)."""

import dataclasses
import itertools
from contextlib import contextmanager

import pytest
import torch
from tensordict import TensorDict

from shmsync import WeightReader
from shmsync.core import header as H
from shmsync.core.protocol import LocalLocks, initialize
from tests.core.interleavings import Accept, Choose, Fail, Fence, Load, Lock, Mark, Store, Unlock
from tests.core.parties import WriterParty
from tests.core.protocol_model import (
    CELLS,
    GIVEN_BACK,
    READER_PID,
    READER_STORES,
    WRITER_STORES,
    Options,
    content,
    holding,
    initial_memory,
    lease_latest,
    promise_stands,
    reader,
    release_lease,
    try_read,
    writer,
)
from tests.weights import Blob


def lease_word(row: int) -> int:
    return H.ROW_WORDS[row][H.R_LEASE]


def bank(word: int) -> int:
    """A word of the host bank (the one the model stands for)."""
    return H.bank_word(H.HOST, word)


IN_PLACE_STORES = frozenset({"row", "leases"})


def header_index(word) -> int | None:
    """The header word the model's ``word`` stands for (None: a slot's contents)."""
    if word == "promised":
        return H.W_PROMISED  # the store's word, not a bank's
    if isinstance(word, tuple):
        name, *index = word
        base = {"seq": bank(H.B_SEQ), "ver": bank(H.B_SLOT_VERSION), "leases": bank(H.B_LEASES)}.get(name)
        if name == "row":
            return lease_word(index[0])
        return None if base is None else base + index[0]
    return bank(
        {
            "version": H.B_VERSION,
            "latest": H.B_LATEST,
            "publish_count": H.B_PUBLISH_COUNT,
            "token_pid": H.B_TOKEN_PID,
            "pin_request": H.B_PIN_REQUEST,
            "pin_grant": H.B_PIN_GRANT,
            "pin_slot": H.B_PIN_SLOT,
            "pin_release": H.B_PIN_RELEASE,
        }[word]
    )


class Recorded(list):
    """A header whose loads and stores, by this party, go into ``log`` as model words."""

    def __init__(self, shared: list, names: dict, log: list, on_store=None) -> None:
        super().__init__()
        self.shared, self.names, self.log, self.on_store = shared, names, log, on_store

    def __len__(self) -> int:
        return len(self.shared)

    def __getitem__(self, i):
        value = self.shared[i]
        indices = range(*i.indices(len(self.shared))) if isinstance(i, slice) else [i]
        for k, v in zip(indices, value if isinstance(i, slice) else [value]):
            if k in self.names:
                self.log.append(("load", self.names[k], v))
        return value

    def __setitem__(self, i, value) -> None:
        self.shared[i] = value
        if i in self.names:
            self.log.append(("store", self.names[i], value))
            if self.on_store:
                self.on_store(self.names[i])


class RecordedLocks(LocalLocks):
    def __init__(self, locks: LocalLocks, log: list) -> None:
        self.inner, self.log = locks, log

    def try_token(self, bank: int = 0) -> bool:
        got = self.inner.try_token(bank)
        self.log.append(("lock", "token", got))
        return got

    def release_token(self, bank: int = 0) -> None:
        self.log.append(("unlock", "token"))
        self.inner.release_token(bank)

    @contextmanager
    def table(self, patience):
        with self.inner.table(patience) as taken:
            self.log.append(("lock", "table", taken))
            yield taken
            self.log.append(("unlock", "table"))

    def hold_row(self, row: int) -> bool:
        return self.inner.hold_row(row)

    def release_row(self, row: int) -> None:
        self.inner.release_row(row)

    def row_alive(self, row: int) -> bool:
        return self.inner.row_alive(row)


def run_model(gen, memory: dict, on_store=None):
    """Run a model party alone on ``memory`` (sequential consistency): its log and return value."""
    log, value = [], None
    try:
        step = gen.send(None)
        while True:
            value = None
            if isinstance(step, Load):
                value = memory[step.word]
                if header_index(step.word) is not None:
                    log.append(("load", step.word, value))
            elif isinstance(step, Store):
                memory[step.word] = step.value
                if header_index(step.word) is not None:
                    log.append(("store", step.word, step.value))
                    if on_store:
                        on_store(step.word)
            elif isinstance(step, Fence):
                log.append(("fence", step.full))
            elif isinstance(step, Lock):
                value = True
                log.append(("lock", step.name, True))
            elif isinstance(step, Unlock):
                log.append(("unlock", step.name))
            elif isinstance(step, Choose):
                raise AssertionError(f"a scenario must not reach a decision on time: {step}")
            elif isinstance(step, Fail):
                raise AssertionError(step.why)
            else:
                assert isinstance(step, (Mark, Accept)), step
            step = gen.send(value)
    except StopIteration as end:
        return log, end.value


def relevant(log: list, own: frozenset) -> list:
    """Stores, fences, lock operations and loads of words another party writes; a party's loads
    of its own words are no scheduling point (nobody else changes them)."""
    out = []
    for entry in log:
        if entry[0] == "load":
            word = entry[1]
            if (word[0] if isinstance(word, tuple) else word) in own:
                continue
        out.append(entry)
    return out


class Pair:
    """The code and the model side by side, from the same fresh store."""

    def __init__(self, slots: int) -> None:
        self.o = Options(slots=slots, give_back=True)
        self.memory = initial_memory(slots)
        self.h = [0] * H.HEADER_WORDS
        initialize(self.h, slots)
        for word, value in self.memory.items():
            k = header_index(word)
            if k is not None:
                self.h[k] = value
        self.h[H.W_VERSION] = self.memory["version"]  # the store's version: its one bank's
        self.names = {header_index(w): w for w in self.memory if header_index(w) is not None}
        self.slots = [[0] * CELLS] + [[-1] * CELLS for _ in range(slots - 1)]
        self.locks = LocalLocks()
        self.writer = WriterParty(self.h, self.locks, ordering="tso", pid=1)
        self.in_place_row = WriterParty(self.h, self.locks, ordering="tso", pid=3).claim_row()
        assert self.in_place_row == 0  # the model's reader in place has row 0

    def protocol(self, pid: int, log: list, on_store=None) -> WriterParty:
        p = WriterParty(Recorded(self.h, self.names, log, on_store), RecordedLocks(self.locks, log), pid=pid)
        p.fence = lambda: log.append(("fence", False))
        p.full_fence = lambda: log.append(("fence", True))
        return p

    # -- the operations, each in the code and in the model -------------------------------------------
    def publish(self):
        code: list = []
        self._publish_code(self.protocol(1, code))
        model, _ = run_model(writer(self.o, 1), self.memory)
        return relevant(code, WRITER_STORES), relevant(model, WRITER_STORES)

    def promised_publish(self):
        """A publish that returns before its copy (CUDA, or the opt-in background copy): promised first."""
        code: list = []
        self._publish_code(self.protocol(1, code), promise=True)
        model, _ = run_model(writer(dataclasses.replace(self.o, promises=True, copy_fails=0), 1), self.memory)
        return relevant(code, WRITER_STORES), relevant(model, WRITER_STORES)

    def failed_publish(self):
        """A promised publish whose copy fails: aborted, its promise withdrawn."""
        code: list = []
        p = self.protocol(1, code)
        write = p.begin_write()
        p.promise(self.h[bank(H.B_VERSION)] + 1)
        p.abort(write)
        p.withdraw()
        model, _ = run_model(writer(dataclasses.replace(self.o, promises=True, copy_fails=1), 1), self.memory)
        return relevant(code, WRITER_STORES), relevant(model, WRITER_STORES)

    def wait_check(self):
        """A waiting reader's look at the promise it read (the newest one)."""
        code: list = []
        target = self.h[H.W_PROMISED]
        stands = self.protocol(READER_PID, code).promise_stands(target)
        model, result = run_model(promise_stands(self.o, target), self.memory)
        assert stands == result
        return relevant(code, READER_STORES), relevant(model, READER_STORES)

    def _publish_code(self, p: WriterParty, promise: bool = False) -> None:
        write = p.begin_write()
        version = self.h[bank(H.B_VERSION)] + 1
        if promise:
            p.promise(version)
        self.slots[write.slot] = [version] * CELLS
        p.commit(write)
        p.give_back_idle(
            lambda slot: self.slots.__setitem__(slot, [GIVEN_BACK] * CELLS),
            lambda slot: self.slots[slot][0] not in (-1, GIVEN_BACK),
        )

    def read(self):
        code: list = []
        got = self.protocol(READER_PID, code).try_read(lambda slot: None)
        model, result = run_model(try_read(self.o), self.memory)
        assert got == (None if result is None else result[0])
        return relevant(code, READER_STORES), relevant(model, READER_STORES)

    def lease(self):
        code: list = []
        got = self.protocol(3, code).lease_latest(self.in_place_row)
        model, result = run_model(lease_latest(self.o), self.memory)
        assert got == result
        return relevant(code, IN_PLACE_STORES), relevant(model, IN_PLACE_STORES)

    def release(self):
        code: list = []
        self.protocol(3, code).release_lease(self.in_place_row)
        model, _ = run_model(release_lease(self.o), self.memory)
        return relevant(code, IN_PLACE_STORES), relevant(model, IN_PLACE_STORES)

    def pinned_read(self):
        """A reader that asks for a pin at once; the writer publishes as soon as the ticket is in
        (and so grants it), out of the log, on each side."""
        code: list = []
        quiet = WriterParty(self.h, self.locks, ordering="tso", pid=1)  # the writer, unrecorded
        quiet.writing = None

        def grant_code(word):
            if word == "pin_request":
                self._publish_code(quiet)

        p = self.protocol(READER_PID, code, grant_code)
        p.outpaced = lambda: True
        version = p.read(lambda slot: None, timeout=5.0)

        def grant_model(word):
            if word == "pin_request":
                run_model(writer(self.o, 1), self.memory)

        model, _ = run_model(reader(self.o, outpaced=True), self.memory, grant_model)
        assert version == self.h[bank(H.B_SLOT_VERSION) + self.h[bank(H.B_PIN_SLOT)]]
        return relevant(code, READER_STORES), relevant(model, READER_STORES)

    def same_words(self) -> None:
        for word, value in self.memory.items():
            k = header_index(word)
            if k is not None:
                assert self.h[k] == value, f"{word}: the code left {self.h[k]}, the model {value}"


OPERATIONS = ["publish", "read", "lease", "release", "pinned_read", "promised_publish", "failed_publish", "wait_check"]


def scenarios(slots: int, length: int):
    for ops in itertools.product(OPERATIONS, repeat=length):
        if slots == 2 and "lease" in ops:
            continue  # never granted with 2 slots: the same as a release
        yield ops


@pytest.mark.parametrize("slots", [3, 2])
def test_each_party_of_the_model_makes_the_codes_steps(slots):
    checked = 0
    for ops in scenarios(slots, 4):
        pair = Pair(slots)
        for n, op in enumerate(ops):
            code, model = getattr(pair, op)()
            assert code == model, (
                f"after {ops[:n]}, {op}: the code and the model part at step "
                f"{next((k for k, (a, b) in enumerate(zip(code, model)) if a != b), min(len(code), len(model)))}"
                f"\ncode:  {code}\nmodel: {model}"
            )
            pair.same_words()
            checked += 1
    assert checked > 500


# -- records: the model's writer and copying reader against a real store's ------------------------------
# Elements of leaf 0 and leaf 1: the bytes a reader copies tell which leaves it copied, and neither
# is small (a reader copies those at every reload, whatever their records say).
SIZES = (1 << 14, 1 << 15)


def leaves(o: Options, version: int) -> TensorDict:
    """Version ``version`` of the model's weights as tensors: leaf ``i`` filled with its content."""
    return TensorDict({f"leaf{i}": torch.full((n,), float(content(o, version, i))) for i, n in enumerate(SIZES)})


@pytest.mark.parametrize("slots", [2, 3])
@pytest.mark.parametrize("publishes", [1, 2, 3])
def test_the_model_writes_and_copies_what_the_code_does(store_factory, slots, publishes):
    """After ``publishes`` publishes of a store (give-backs included) every slot's version, leaves
    and records are the model writer's; then a copying reader that held version 0 copies the leaves
    the model's reader copies (and holds what it says)."""
    o = Options(slots=slots, give_back=True, records=True)
    store = store_factory(leaves(o, 0), num_slots=slots)
    reader = WeightReader(store, Blob({f"leaf{i}": n for i, n in enumerate(SIZES)}), zero_copy=False)
    reader.poll()  # version 0, whole
    for version in range(1, publishes + 1):
        store.publish(leaves(o, version))
    store.flush()  # the give-backs after the last publish
    memory = initial_memory(slots, records=True)
    run_model(writer(o, publishes), memory)
    h, records, slot_views = store.memory.header, store.memory.records, store.memory.map_slots()
    for s in range(slots):
        version = h[bank(H.B_SLOT_VERSION) + s]
        assert version == memory[("ver", s)], f"slot {s}"
        if version >= 0:
            assert [records[s * 2 + i] for i in range(2)] == [memory[("rec", s, i)] for i in range(2)], f"slot {s}"
            assert [float(v[0]) for v in slot_views[s]] == [memory[("data", s, i)] for i in range(2)], f"slot {s}"
    have = holding(o)
    run_model(try_read(o, have), memory)
    assert reader.poll() and reader.version == publishes
    copied = {i for i, n in enumerate(SIZES) if reader.copied_bytes & (4 * n)}
    assert copied == have[2], f"the code copied leaves {copied}, the model {have[2]}"
    assert [float(t[0]) for t in reader.module.state_dict().values()] == [content(o, publishes, i) for i in range(2)]
