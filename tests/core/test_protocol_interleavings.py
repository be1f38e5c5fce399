"""Every interleaving of small configurations of the slot protocol (shmsync/core/protocol.py, as
modelled in tests/core/protocol_model.py), explored on sequential consistency, on x86-TSO and on the
weak order of aarch64, with crashes; and the checker shown to fail when a fence or a rule that the
protocol's argument rests on is taken away.

Each configuration is the writer publishing a few times beside two readers, with one load each
(the reader in place's first lease moves to another slot on its second reload where it has
two); the explored state counts are printed at the end of the run. What each mode does not
cover is said in docs/protocol.md."""

import dataclasses

import pytest
from _pytest.mark import ParameterSet

from tests.core.protocol_model import Options, explore


def heavier(*config):
    """A larger configuration (20-130 s each): explored by `make test-full` (and `make
    test-protocol`), not by `make test`, whose smaller configurations of each mode find every
    mutation's counterexample below but the deepest."""
    return pytest.param(*config, marks=pytest.mark.full)


# id: (mode, slots, explore's arguments)
CONFIGURATIONS = {
    # Sequential consistency: the rules, slot choice, pins, leases, the stopped token holder.
    "sc: optimistic and readers in place, 3 publishes": heavier(
        "sc", 3, {"readers": "optimistic,in-place", "reloads": 2}
    ),
    "sc: a pinned and a reader in place": heavier("sc", 3, {"publishes": 2, "readers": "pinned,in-place"}),
    "sc: 2 slots, optimistic and readers in place": ("sc", 2, {"readers": "optimistic,in-place"}),
    "sc: 2 slots, a reader either way": ("sc", 2, {"readers": "plain"}),
    "sc: a reader beside a token holder stopped for good": ("sc", 3, {"readers": "plain,stopped"}),
    # Crashes: any party dies anywhere; a new writer takes over, or none does.
    "sc crashes: a reader either way, a new writer": ("sc", 3, {"readers": "plain", "crashes": True}),
    "sc crashes: a reader either way, no new writer": (
        "sc",
        3,
        {"readers": "plain", "crashes": True, "new_writer": False},
    ),
    "sc crashes: a reader in place": heavier("sc", 3, {"readers": "in-place", "reloads": 2, "crashes": True}),
    "sc crashes: a pinned reader and a stopped one": heavier(
        "sc",
        3,
        {"publishes": 2, "readers": "pinned,stopped", "crashes": True},
    ),
    # x86-TSO: store buffers, the full fences of the handshakes.
    "tso: a reader in place": ("tso", 3, {"readers": "in-place", "reloads": 2}),
    "tso: a reader either way": ("tso", 3, {"readers": "plain"}),
    "tso: a pinned and a reader in place": heavier("tso", 3, {"publishes": 1, "readers": "pinned,in-place"}),
    "tso: 2 slots, a reader either way": ("tso", 2, {"publishes": 2, "readers": "plain"}),
    "tso crashes: a reader in place": heavier("tso", 3, {"readers": "in-place", "crashes": True}),
    # The weak order: every fence, stale loads, stores out of order.
    "weak: 2 slots, an optimistic reader": heavier("weak", 2, {"publishes": 2, "readers": "optimistic"}),
    "weak: 2 slots, a reader either way, one publish": ("weak", 2, {"publishes": 1, "readers": "plain"}),
    "weak: a reader in place": heavier("weak", 3, {"publishes": 2, "readers": "in-place"}),
    # Memory given back after each publish (WriterParty.give_back_idle, as StoreWriter._give_back_idle), in every mode.
    "sc give-backs: a reader in place (two reloads)": (
        "sc",
        3,
        {"readers": "in-place", "reloads": 2, "give_back": True},
    ),
    "sc give-backs: an optimistic and a reader in place": (
        "sc",
        3,
        {"publishes": 2, "readers": "optimistic,in-place", "reloads": 2, "give_back": True},
    ),
    "sc give-backs: a pinned and a reader in place": heavier(
        "sc",
        3,
        {"publishes": 2, "readers": "pinned,in-place", "give_back": True},
    ),
    "sc give-backs: a pinned and a reader in place, one publish": (
        "sc",
        3,
        {"publishes": 1, "readers": "pinned,in-place", "give_back": True},
    ),
    "sc crashes, give-backs: a reader in place": (
        "sc",
        3,
        {"publishes": 2, "readers": "in-place", "reloads": 2, "crashes": True, "give_back": True},
    ),
    "tso give-backs: a reader in place (two reloads)": (
        "tso",
        3,
        {"readers": "in-place", "reloads": 2, "give_back": True},
    ),
    "weak give-backs: a reader in place": heavier(
        "weak", 3, {"publishes": 2, "readers": "in-place", "give_back": True}
    ),
    # Promises: each version promised before its copy, which may fail; a worker waits for it.
    "sc crashes, promises: a waiting reader, a new writer": (
        "sc",
        3,
        {"publishes": 2, "readers": "waiting", "crashes": True, "promises": True},
    ),
    "sc crashes, promises: a waiting and an optimistic reader, no new writer": (
        "sc",
        3,
        {"publishes": 2, "readers": "waiting,optimistic", "crashes": True, "new_writer": False, "promises": True},
    ),
    "tso crashes, promises: a waiting and an optimistic reader": heavier(
        "tso",
        3,
        {"publishes": 2, "readers": "waiting,optimistic", "crashes": True, "promises": True},
    ),
    "tso crashes, promises: a waiting reader, one publish": (
        "tso",
        3,
        {"publishes": 1, "readers": "waiting", "crashes": True, "promises": True},
    ),
    # Records: the writer writes only what a slot lacks, with its records; a reader that holds
    # version 0 copies only the leaves whose record is newer (Options.records), in every mode.
    "sc records: 2 slots, a reader either way": ("sc", 2, {"readers": "plain", "records": True}),
    "sc records, give-backs: an optimistic and a reader in place": (
        "sc",
        3,
        {"publishes": 2, "readers": "optimistic,in-place", "give_back": True, "records": True},
    ),
    "sc crashes, records: 2 slots, an optimistic reader, a new writer publishing twice": (
        "sc",
        2,
        {"publishes": 2, "readers": "optimistic", "crashes": True, "records": True, "takeover_publishes": 2},
    ),
    "sc crashes, records: a reader either way, no new writer": (
        "sc",
        3,
        {"readers": "plain", "crashes": True, "new_writer": False, "records": True},
    ),
    "sc crashes, records: a reader either way, a new writer publishing twice": heavier(
        "sc",
        3,
        {"publishes": 2, "readers": "plain", "crashes": True, "records": True, "takeover_publishes": 2},
    ),
    "tso records: a reader either way": ("tso", 3, {"readers": "plain", "records": True}),
    "tso crashes, records: 2 slots, an optimistic reader, a new writer publishing twice": (
        "tso",
        2,
        {"publishes": 1, "readers": "optimistic", "crashes": True, "records": True, "takeover_publishes": 2},
    ),
    "weak records: 2 slots, a reader either way, one publish": (
        "weak",
        2,
        {"publishes": 1, "readers": "plain", "records": True},
    ),
    "weak records: 2 slots, an optimistic reader": heavier(
        "weak", 2, {"publishes": 2, "readers": "optimistic", "records": True}
    ),
}


OPTIONS = {f.name for f in dataclasses.fields(Options)}


def _explore(mode: str, slots: int, arguments: dict, **mutation):
    """``arguments``: the explorer's, and the model's options (``reloads``, ``give_back``, ...)."""
    chosen = {k: v for k, v in arguments.items() if k in OPTIONS}
    options = Options(slots=slots, **{"reloads": 1, **chosen}, **mutation)
    return explore(mode, options, **{k: v for k, v in arguments.items() if k not in OPTIONS})


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "mode, slots, arguments",
    [
        pytest.param(*c.values, marks=c.marks, id=k) if isinstance(c, ParameterSet) else pytest.param(*c, id=k)
        for k, c in CONFIGURATIONS.items()
    ],
)
def test_every_interleaving_keeps_the_protocols_guarantees(mode, slots, arguments, request, record_property):
    result = _explore(mode, slots, arguments)
    record_property("explored", f"{request.node.callspec.id} ({slots} slots): {result.summary()}")
    assert result.failure is None, result.report()
    assert result.schedules > 0 and result.states > 1000


# A rule or fence taken away, where its absence shows, and what the checker then finds.
MUTATIONS = {
    "no_writer_full_fence": ("tso", 3, {"readers": "in-place"}, "being written while a reader in place uses it"),
    "no_confirm_fence": ("tso", 3, {"readers": "in-place"}, "being written while a reader in place uses it"),
    "no_reader_full_fence": (  # from mid-publish, the readers' moves tried first: met at 168,000 states
        "tso",
        3,
        {"publishes": 2, "readers": "pinned,in-place", "begun": True, "later_first": True},
        "under a confirmed lease or a pin",
    ),
    "no_granting_check": ("sc", 3, {"publishes": 2, "readers": "pinned,in-place"}, "under a confirmed lease or a pin"),
    "no_give_way": ("sc", 2, {"publishes": 2, "readers": "optimistic,in-place"}, "would have to wait"),
    "latest_before_even": (
        "sc",
        3,
        {"publishes": 2, "readers": "optimistic", "crashes": True, "new_writer": False},
        "can never all get done",
    ),
    "no_read_fences": ("weak", 2, {"publishes": 2, "readers": "optimistic"}, "accepted slot"),
    "no_commit_fence": ("weak", 2, {"publishes": 2, "readers": "optimistic"}, "accepted slot"),
    "no_lease_version_fence": ("weak", 3, {"readers": "in-place"}, "accepted slot"),
    "no_give_back_handshake": (
        "sc",
        3,
        {"readers": "in-place", "reloads": 2, "give_back": True},
        "accepted slot",  # a lease confirmed on a slot given back meanwhile
    ),
    "give_back_pinned": (  # the readers' moves tried first: met at 37,000 states
        "sc",
        3,
        {"readers": "pinned,in-place", "reloads": 2, "give_back": True, "later_first": True},
        "being written while a reader copies",
    ),
    "accept_empty": ("sc", 3, {"readers": "in-place", "reloads": 2, "give_back": True}, "accepted slot"),
    # A promise left hanging: a worker waiting for it, with its writer alive, never gets done.
    "no_withdraw": ("sc", 3, {"publishes": 1, "readers": "waiting", "promises": True}, "can never all get done"),
    "wait_on_withdrawn": ("sc", 3, {"publishes": 1, "readers": "waiting", "promises": True}, "can never all get done"),
    # Records: a reader accepting a version whose leaves are not all that version's.
    "records_after_commit": ("sc", 2, {"publishes": 2, "readers": "optimistic", "records": True}, "accepted slot"),
    "record_below_truth": ("sc", 2, {"publishes": 2, "readers": "optimistic", "records": True}, "accepted slot"),
    "no_touched": ("tso", 2, {"publishes": 2, "readers": "optimistic", "records": True}, "accepted slot"),
    "records_before_seq": ("weak", 2, {"publishes": 2, "readers": "optimistic", "records": True}, "accepted slot"),
}
# Their counterexamples lie deep (20 s, 10 s): slow; the deepest in `make test-full` only.
DEEP = {"no_reader_full_fence": [pytest.mark.slow, pytest.mark.full], "give_back_pinned": [pytest.mark.slow]}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mutation", [pytest.param(m, marks=DEEP.get(m, [])) for m in MUTATIONS])
def test_the_checker_finds_a_counterexample_without(mutation):
    mode, slots, arguments, finding = MUTATIONS[mutation]
    result = _explore(mode, slots, arguments, **{mutation: True})
    assert result.failure is not None and finding in result.failure, result.failure
    report = result.report()
    assert report.startswith(result.failure) and "\n1. " in report  # a numbered schedule to follow
    assert all(line.split(". ", 1)[0].strip().isdigit() or line.startswith("   ") for line in result.trace)
