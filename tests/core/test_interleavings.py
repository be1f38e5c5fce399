"""The explorer (tests/core/interleavings.py) on litmus tests whose outcomes under each memory model
are known (the store-buffering, message-passing and coherence tests of the CPU memory-model
literature), on a configuration that gets stuck, and with its reduction against without it."""

import pytest

from tests.core.interleavings import Explorer, Fence, Load, Lock, Party, Store, Unlock
from tests.core.protocol_model import explorer

MODES = ["sc", "tso", "weak"]


def outcome(results: tuple[str, ...], forbidden: tuple[int, ...]):
    """An invariant that fails once the parties' results are ``forbidden``."""

    def observe(x: Explorer, state: tuple) -> tuple:
        return tuple(x.word(state, r) for r in results)

    def check(facts: tuple) -> str | None:
        return f"outcome {facts}" if facts == forbidden else None

    return observe, check


def litmus(parties: dict, memory: dict, results: tuple, forbidden: tuple, mode: str, **kwargs):
    observe, check = outcome(results, forbidden)
    party_list = [Party(name, make, stores=frozenset(stores)) for name, (make, stores) in parties.items()]
    return Explorer(party_list, memory, mode, observe=observe, check=check, **kwargs).run()


def store_buffering(fenced: bool):
    """x = 1; r0 = y  ||  y = 1; r1 = x: both loads may see 0 only if a store waits in a buffer."""

    def side(mine, other, result):
        def run():
            yield Store(mine, 1)
            if fenced:
                yield Fence(full=True)
            value = yield Load(other)
            yield Store(result, value)

        return run, {mine, result}

    parties = {"a": side("x", "y", "r0"), "b": side("y", "x", "r1")}
    return parties, {"x": 0, "y": 0, "r0": -1, "r1": -1}, ("r0", "r1"), (0, 0)


def message_passing(fenced: bool):
    """data = 1; flag = 1  ||  r0 = flag; r1 = data: the flag without the data is a reordering."""

    def send():
        yield Store("data", 1)
        if fenced:
            yield Fence()
        yield Store("flag", 1)

    def receive():
        flag = yield Load("flag")
        if fenced:
            yield Fence()
        data = yield Load("data")
        yield Store("r0", flag)
        yield Store("r1", data)

    parties = {"sender": (send, {"data", "flag"}), "receiver": (receive, {"r0", "r1"})}
    return parties, {"data": 0, "flag": 0, "r0": -1, "r1": -1}, ("r0", "r1"), (1, 0)


def coherence():
    """x = 1; x = 2  ||  r0 = x; r1 = x: no CPU lets a later load see an older value of one word."""

    def write():
        yield Store("x", 1)
        yield Store("x", 2)

    def read():
        first = yield Load("x")
        second = yield Load("x")
        yield Store("r0", first)
        yield Store("r1", second)

    parties = {"writer": (write, {"x"}), "reader": (read, {"r0", "r1"})}
    return parties, {"x": 0, "r0": -1, "r1": -1}, ("r0", "r1"), (2, 1)


# test, mode -> whether the forbidden outcome is reachable there
EXPECTED = {
    ("store buffering", False): {"sc": False, "tso": True, "weak": True},
    ("store buffering", True): {"sc": False, "tso": False, "weak": False},
    ("message passing", False): {"sc": False, "tso": False, "weak": True},
    ("message passing", True): {"sc": False, "tso": False, "weak": False},
    ("coherence", False): {"sc": False, "tso": False, "weak": False},
}
BUILD = {"store buffering": store_buffering, "message passing": message_passing, "coherence": lambda _: coherence()}


@pytest.mark.parametrize("reduce", [True, False], ids=["reduced", "full"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("test", "fenced"), list(EXPECTED), ids=lambda v: v if isinstance(v, str) else "")
def test_litmus_outcomes_are_those_of_the_memory_model(test, fenced, mode, reduce):
    result = litmus(*BUILD[test](fenced), mode, reduce=reduce)
    assert (result.failure is not None) == EXPECTED[(test, fenced)][mode], result.failure
    if result.failure:
        assert result.trace[0].startswith("1. ") and len(result.trace) >= 3


def test_a_party_that_can_never_finish_is_reported_with_the_state_it_stays_in():
    def holder():
        yield Lock("table")  # and never lets go

    def waiter():
        yield Lock("table")
        yield Unlock("table")

    parties = [Party("holder", holder, stores=frozenset()), Party("waiter", waiter, stores=frozenset())]
    result = Explorer(parties, {"x": 0}, "sc", observe=lambda x, s: (), check=lambda facts: None).run()
    assert result.failure is not None and "can never all get done" in result.failure
    assert any("waiter: next: Lock" in line for line in result.trace)


def test_a_store_of_a_word_a_party_does_not_list_is_an_error():
    def sneaky():
        yield Store("y", 1)

    with pytest.raises(AssertionError, match="does not list"):
        Explorer(
            [Party("p", sneaky, stores=frozenset({"x"}))],
            {"x": 0, "y": 0},
            "sc",
            observe=lambda x, s: (),
            check=lambda f: None,
        ).run()


@pytest.mark.parametrize(
    ("mode", "kwargs"),
    [
        pytest.param("sc", {"publishes": 2, "readers": "optimistic,in-place"}, id="sc"),
        pytest.param("tso", {"publishes": 3, "readers": "in-place"}, id="tso"),
        pytest.param("weak", {"publishes": 1, "readers": "optimistic"}, id="weak"),
        pytest.param("sc", {"publishes": 2, "readers": "pinned,stopped"}, id="stopped"),
        # Every crash point explored twice over: seconds of CPU.
        pytest.param(
            "sc", {"publishes": 2, "readers": "in-place", "crashes": True}, id="crashes", marks=pytest.mark.slow
        ),
    ],
)
def test_the_reduction_sees_every_fact_the_invariant_sees_without_it(mode, kwargs):
    """Whatever order of the moves it leaves out, the reduced search meets every combination of the
    facts the invariant looks at that the full search meets, and every final state."""
    from tests.core.protocol_model import Options

    o = Options(slots=3, reloads=1)
    seen = {}
    for reduce in (False, True):
        x = explorer(mode, o, reduce=reduce, **kwargs)
        result = x.run()
        assert result.failure is None, result.report()
        seen[reduce] = (set(x._observed.values()), result)
    assert seen[True][0] == seen[False][0]
    assert seen[True][1].states < seen[False][1].states
