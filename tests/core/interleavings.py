"""An exhaustive explorer of the interleavings of a few parties over shared words.

A party is a generator that yields one step for each load, store and fence of a shared word and
each kernel-lock operation: a point where another party, or a store buffer, may go first. The
explorer visits every state the parties can reach, depth first:

* a party's state is read off its suspended generator (its frames' lines and locals), so that
  states reached by different schedules are one; a generator is rebuilt by replaying one history
  of values that leads to its state, and a party whose next step depends on anything its state
  does not hold is caught (the same state must always make the same next step);
* memory: ``"sc"`` (every store seen at once), ``"tso"`` (x86-64: each party's stores drain in
  order from a buffer its own loads read first; ``full_fence`` and kernel locks drain it;
  ``fence`` is nothing), ``"weak"`` (aarch64 as ``SHMSYNC_ORDERING=weak`` has it: stores to
  different words drain in any order, a load may return a value older than the newest, never
  older than one this party saw or one there was at its last fence; ``fence`` and
  ``full_fence`` are both a full barrier);
* crashes: in any state any party may die there; its kernel locks are released, its words left
  as they are (stores in its buffer still drain); a writer that dies is replaced by a new one.

In every state the caller's invariant holds; every copy a party accepts is whole; and from every
state a state where every party still alive is done can be reached without another death (no
deadlock, no livelock, whatever died). A failure is reported with the shortest schedule to it
among the moves explored, one numbered line per step.

Reduction. Two schedules that differ only in the order of independent steps (steps of different
parties that touch different words, or only load the same one) reach the same states, and only
one of them needs exploring. In each state the explorer looks for a set of parties ``T`` whose
next steps are independent of everything the other parties could do while ``T`` waits: each
other party is run alone from the state (its *solo future*: what it loads, stores and locks with
nobody else moving); if no solo future conflicts with a next step of ``T``, nor with another's,
only ``T``'s moves are explored (a persistent set). Two provisos keep this exact: none of those
moves may change what the invariant looks at (else every move is explored), and none may lead
back to a state already found (so that no party is put off forever around a cycle). Steps that
touch nothing another party can see (a store into the party's own buffer, a fence that is no
barrier, a load of a word nobody else stores any more) are taken together with the step before.
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

# -- the steps a party yields ------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    word: Any


@dataclass(frozen=True)
class Store:
    word: Any
    value: int


@dataclass(frozen=True)
class Fence:
    full: bool = False  # full_fence() (else fence())


@dataclass(frozen=True)
class Lock:
    name: str
    wait: bool = True  # False: try once (the value sent back says whether it was taken)


@dataclass(frozen=True)
class Unlock:
    name: str


@dataclass(frozen=True)
class Choose:
    """A decision the code takes on time (a copy's duration, a patience): every answer is explored."""

    options: int
    why: str


@dataclass(frozen=True)
class Mark:
    """Not a step: the party enters (``slot >= 0``) or leaves a region the invariant looks at."""

    region: str
    slot: int = -1


@dataclass(frozen=True)
class Accept:
    """Not a step: a reader accepts a copy of ``slot`` as version ``version`` with these cells,
    which must be ``expected`` (default: each cell holds ``version``)."""

    version: int
    cells: tuple[int, ...]
    slot: int
    pinned: bool = False
    expected: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Fail:
    """Not a step: the code raises here."""

    why: str


DONE, DEAD, WAITING = "done", "dead", "waiting"
TOP = None  # a footprint that may conflict with anything


@dataclass
class Party:
    """One process of the configuration.

    Args:
        name: how the reports call it.
        make: a fresh generator of its steps.
        locks: kernel locks it holds while it lives (its reader row, say).
        stops: it may be left stopped forever (a ``Mark("stopped")``): the others must not need it.
        stores: the names of the words it may store; a store of another word is an error. What
            the others' loads may depend on.
        writer: a writer, replaced by the explorer's replacement when it dies.
    """

    name: str
    make: Callable[[], Generator]
    locks: tuple[str, ...] = ()
    stops: bool = False
    stores: frozenset[str] = frozenset()
    writer: bool = False


class Program:
    """One party's behaviour as a map from state to next step: each state met once is rebuilt by
    replaying a history of values that leads to it."""

    def __init__(self, party: Party) -> None:
        self.party = party
        self.history: dict[Any, tuple] = {}
        self.step: dict[Any, Any] = {}
        self.edges: dict[tuple, tuple] = {}
        self.start = self._run(())

    def _run(self, history: tuple) -> Any:
        """Run a fresh generator through ``history``; its state after (its next step noted)."""
        gen = self.party.make()
        marks: list = []
        try:
            step = self._next(gen, None, marks)
            for value in history:
                marks = []
                step = self._next(gen, value, marks)
        except StopIteration:
            return (DONE, tuple(marks))
        key = (_frames(gen), tuple(marks))
        if key in self.step:
            if self.step[key] != step:
                raise AssertionError(f"{self.party.name}: state {key} makes two next steps: its state misses a local")
        else:
            self.step[key], self.history[key] = step, history
        return key

    @staticmethod
    def _next(gen: Generator, value: Any, marks: list) -> Any:
        """Resume ``gen`` with ``value`` until its next step; markers on the way go into ``marks``."""
        step = gen.send(value)
        while isinstance(step, (Mark, Accept, Fail)):
            marks.append(step)
            step = gen.send(None)
        return step

    def after(self, key: Any, value: Any) -> Any:
        edge = (key, value)
        nxt = self.edges.get(edge)
        if nxt is None:
            nxt = self.edges[edge] = self._run((*self.history[key], value))
        return nxt


def _frames(gen: Generator) -> tuple:
    """The suspended generator's frames, outermost first: line and locals of each."""
    out = []
    while gen is not None and gen.gi_frame is not None:
        frame = gen.gi_frame
        local = tuple(sorted((k, _hashable(v)) for k, v in frame.f_locals.items() if k != "o"))
        out.append((frame.f_code.co_name, frame.f_lineno, local))
        gen = gen.gi_yieldfrom
    return tuple(out)


def _hashable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return frozenset(value)
    if isinstance(value, dict):
        return tuple(sorted(value.items()))
    return value


class Move(NamedTuple):
    owner: int  # the party whose move it is (its step, a store leaving its buffer, or its death)
    label: tuple  # what happened, step by step; rendered only for a report
    state: tuple
    problem: str | None
    footprint: frozenset | None  # ("L"/"S", word) and ("K", lock) it touches; TOP: anything


@dataclass
class Result:
    mode: str
    states: int = 0
    transitions: int = 0
    schedules: int = 0  # maximal schedules: paths to a state where every living party is done
    reduced: int = 0  # states where only a persistent subset of the moves was explored
    failure: str | None = None
    trace: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.mode}: {self.states:,} states, {self.transitions:,} transitions, {self.schedules:,} schedules"
            f" ({self.reduced:,} states reduced)"
        )

    def report(self) -> str:
        return "\n".join([f"{self.failure}; the shortest schedule found:", *self.trace])


SOLO_LIMIT = 400  # states of one party's solo future before it is taken to touch anything


class Explorer:
    """Every state the parties reach, depth first, with the checks of the module's docstring.

    Args:
        parties: the parties, in order.
        memory: each shared word's first value.
        mode: ``"sc"``, ``"tso"`` or ``"weak"``.
        observe: ``observe(explorer, state)``, the hashable facts the invariant looks at (a move
            that changes them is never put off).
        check: the invariant: a problem with those facts, or None.
        crashes: any party may die in any state (a writer that dies is replaced by ``replacement``,
            which starts once the dead writer's last stores reached memory).
        replacement: the new writer, when one dies.
        monotonic: words whose value must never go down.
        reduce: explore a persistent subset of the moves where one is found (see the docstring).
        later_first: try the later parties' moves first. Only the order of the depth-first search
            changes: the same states are explored when there is nothing to find; a problem that
            needs the later parties to go first is met sooner.
        max_states: give up (an error) beyond this many states.
    """

    def __init__(
        self,
        parties: list[Party],
        memory: dict,
        mode: str,
        *,
        observe: Callable[[Explorer, tuple], Any],
        check: Callable[[Any], str | None],
        crashes: bool = False,
        replacement: Party | None = None,
        monotonic: tuple = (),
        reduce: bool = True,
        later_first: bool = False,
        max_states: int = 2_000_000,
    ) -> None:
        if mode not in ("sc", "tso", "weak"):
            raise ValueError(f"mode {mode!r}: one of 'sc', 'tso', 'weak'")
        self.parties = parties + ([replacement] if replacement is not None else [])
        self.replacing = len(parties) if replacement is not None else None
        self.programs = [Program(p) for p in self.parties]
        self.mode, self.crashes, self.reduce, self.max_states = mode, crashes, reduce, max_states
        self.later_first = later_first
        self.observe, self.check, self.monotonic = observe, check, monotonic
        self._simulated: dict = {}  # _simulate's results by what they depended on
        self._observed: dict = {}  # observe's facts by state
        self.words = sorted(memory, key=repr)
        self.index = {w: i for i, w in enumerate(self.words)}
        self.initial_memory = tuple(memory[w] for w in self.words)

    # A state: (memory, histories, parties, buffers, views, locks, regions). memory: a value per
    # word; histories (weak only): per word, the values it had, oldest first, the last one being
    # the memory's; parties: each party's program state (or DEAD, or WAITING for the replacement);
    # buffers: each party's stores not yet in memory, oldest first; views (weak): per party, per
    # word, the oldest history entry it may still read; locks: (name, holder) pairs; regions: per
    # party, the (region, slot) it is in.
    def initial(self) -> tuple:
        n = len(self.parties)
        starts = [prog.start for prog in self.programs]
        if self.replacing is not None:
            starts[self.replacing] = WAITING
        histories = tuple((v,) for v in self.initial_memory) if self.mode == "weak" else ()
        views = tuple(tuple(0 for _ in self.words) for _ in range(n)) if self.mode == "weak" else ()
        locks = tuple(sorted((name, i) for i, p in enumerate(self.parties) for name in p.locks if starts[i] != WAITING))
        regions = tuple(() for _ in range(n))
        state = (self.initial_memory, histories, tuple(starts), tuple(() for _ in range(n)), views, locks, regions)
        return self._settle(state, range(n))[0]

    def run(self) -> Result:
        # The tables below hold hundreds of thousands of nested tuples and no reference cycles:
        # the cyclic collector would rescan them again and again for nothing (a third of the time).
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run()
        finally:
            if enabled:
                gc.enable()

    def _run(self) -> Result:
        result = Result(self.mode)
        start = self.initial()
        parent: dict[tuple, tuple | None] = {start: None}  # how each state was first found
        successors: dict[tuple, list[tuple]] = {}
        lasting = successors if not self.crashes else {}  # the moves that are no death
        on_stack: set[tuple] = set()
        stack: list[tuple[tuple, list[Move], int]] = []
        failed: tuple | None = None

        def enter(state: tuple) -> str | None:
            problem = self.check(self._facts(state))
            if problem:
                return problem
            on_stack.add(state)
            moves, reduced = self._expand(state, on_stack)
            if self.later_first:
                moves.reverse()
            result.reduced += reduced
            result.transitions += len(moves)
            successors[state] = [m.state for m in moves]
            if self.crashes:  # the survivors must get done without anyone else dying
                lasting[state] = [m.state for m in moves if m.label[0][1] != "dies"]
            stack.append((state, moves, 0))
            return None

        # Depth first, so that the cycle proviso needs only the states on the stack.
        problem = enter(start)
        failed = start if problem else None
        while stack and failed is None:
            state, moves, k = stack[-1]
            if k == len(moves):
                stack.pop()
                on_stack.discard(state)
                continue
            stack[-1] = (state, moves, k + 1)
            move = moves[k]
            if move.state in parent:
                if move.problem:
                    problem, failed = move.problem, move.state
                continue
            parent[move.state] = (state, move.label)
            problem = move.problem or enter(move.state)
            if problem:
                failed = move.state
            elif len(parent) > self.max_states:
                raise RuntimeError(f"more than {self.max_states:,} states: the configuration is too large to explore")
        result.states = len(parent)
        if failed is not None:
            result.failure, result.trace = problem, self._shortest(successors, start, {failed}, parent)[1]
        else:
            self._check_progress(successors, lasting, parent, start, result)
        return result

    # -- moves -------------------------------------------------------------------------------------
    def _steps(self, i: int, p: Any) -> bool:
        """Whether party ``i`` in program state ``p`` has a next step of its own to take."""
        if p in (DEAD, WAITING) or p[0] == DONE:
            return False
        return not (self.parties[i].stops and any(isinstance(m, Mark) and m.region == "stopped" for m in p[1]))

    def moves_of(self, state: tuple, i: int) -> list[Move]:
        """Party ``i``'s moves: its next step (one per value it may see), a store leaving its
        buffer, its death."""
        _, _, parties, buffers, _, locks, _ = state
        p = parties[i]
        out = []
        if self._steps(i, p):
            step = self.programs[i].step[p]
            for value, effects, label, footprint in self._perform(state, i, step):
                nxt, problem, labels = self._advance(state, i, value, effects, label)
                out.append(Move(i, labels, nxt, problem, footprint))
        buffer = buffers[i]
        if buffer:
            if self.mode == "tso":
                indices = [0]
            else:  # weak: any store no earlier store of the same word holds back
                indices = [k for k, (w, _) in enumerate(buffer) if all(w != w2 for w2, _ in buffer[:k])]
            for k in indices:
                word, value = buffer[k]
                nxt, problem = self._write(state, word, value, i)
                nb = list(nxt[3])
                nb[i] = buffer[:k] + buffer[k + 1 :]
                nxt = nxt[:3] + (tuple(nb),) + nxt[4:]
                footprint: frozenset | None = frozenset({("S", word)})
                if p == DEAD and not nb[i] and self._replaces(nxt, i):
                    nxt, footprint = self._start_replacement(nxt), TOP
                out.append(Move(i, ((i, "drain", word, value, ""),), nxt, problem, footprint))
        if self.crashes and p not in (DEAD, WAITING) and p[0] != DONE:
            out.append(self._crash(state, i))
        return out

    def _expand(self, state: tuple, on_stack: set) -> tuple[list[Move], int]:
        """The moves to explore from ``state`` (a persistent subset where one is found), and
        whether it is a subset."""
        groups = {}
        for i in range(len(self.parties)):
            moves = self.moves_of(state, i)
            if moves:
                groups[i] = moves
        every = [m for moves in groups.values() for m in moves]
        if not self.reduce or len(groups) < 2:
            return every, 0
        seen = self._facts(state)
        for i in sorted(groups, key=lambda i: len(groups[i])):
            chosen = self._persistent(state, i, groups)
            if chosen is None:
                continue
            moves = [m for t in chosen for m in groups[t]]
            if all(m.label[0][1] == "dies" for m in moves):
                continue  # deaths alone (parties that wait for a lock): the progress check needs a move that lasts
            if any(m.state in on_stack for m in moves):
                continue  # the cycle proviso: never put the others off around a loop
            if any(self._facts(m.state) != seen for m in moves):
                continue  # the visibility proviso: the invariant sees every order of these
            return moves, 1
        return every, 0

    def _facts(self, state: tuple) -> Any:
        facts = self._observed.get(state)
        if facts is None:
            facts = self._observed[state] = self.observe(self, state)
        return facts

    def _persistent(self, state: tuple, first: int, groups: dict) -> set[int] | None:
        """Parties, ``first`` among them, whose moves are independent of whatever the others can
        do while they wait; None if that takes every party with a move. A party with no move (it
        waits for a lock) whose future conflicts brings in the lock's holder instead: while the
        holder waits, so does it."""
        chosen = {first}
        while True:
            footprint: set = set()
            for t in chosen:
                for m in groups[t]:
                    if m.footprint is TOP:
                        return None
                    footprint |= m.footprint
            others = [j for j in range(len(self.parties)) if j not in chosen]
            futures = self._futures(state, others, chosen)
            culprit = None
            for j in others:
                f = futures[j]
                if f is TOP or _conflict(f, footprint):
                    culprit = j if j in groups else self._holder_awaited(state, j)
                    if culprit is not None and culprit not in chosen:
                        break
                    culprit = None
            if culprit is None:
                return chosen if any(j in groups for j in others) else None
            chosen.add(culprit)

    def _holder_awaited(self, state: tuple, j: int) -> int | None:
        p = state[2][j]
        if self._steps(j, p):
            step = self.programs[j].step[p]
            if isinstance(step, Lock):
                return dict(state[5]).get(step.name)
        return None

    def _futures(self, state: tuple, others: list[int], frozen: set[int]) -> dict[int, frozenset | None]:
        """What each of ``others`` may touch while the ``frozen`` parties wait: each is run alone,
        its loads seeing, beside what memory holds, every value the others may store meanwhile
        (again for each whose loads the others' stores reach, until those values settle), so the
        futures hold in every interleaving of them."""
        futures: dict[int, frozenset | None] = {}
        stored: dict[int, dict] = {}
        locking: dict[int, set] = {}
        for j in others:
            result = self._simulate(state, j, {}, set(), frozen)
            if result is TOP:
                return dict.fromkeys(others, TOP)
            futures[j], stored[j], locking[j] = result
        for _ in range(5):
            changed = False
            for j in others:
                env: dict = {}
                contended: set = set()
                for k in others:
                    if k != j:
                        for w, values in stored[k].items():
                            if ("L", w) in futures[j]:
                                env.setdefault(w, set()).update(values)
                        contended |= locking[k] & locking[j]
                if not env and not contended:
                    continue  # nothing another may do reaches it: its own future stands
                result = self._simulate(state, j, env, contended, frozen)
                if result is TOP:
                    return dict.fromkeys(others, TOP)
                if result[0] != futures[j] or result[1] != stored[j] or result[2] != locking[j]:
                    futures[j], stored[j], locking[j] = result
                    changed = True
            if not changed:
                return futures
        return dict.fromkeys(others, TOP)

    def _simulate(self, state: tuple, j: int, env: dict, contended: set, frozen: set[int]):
        """Party ``j`` alone from ``state``, its loads also seeing the values in ``env`` and the
        locks in ``contended`` also taken by others: what it touches (its footprint), the values
        it stores, the locks it takes; TOP if that cannot be bounded. Remembered by what it read."""
        parties, buffers, locks = state[2], state[3], state[5]
        p = parties[j]
        if p in (DEAD, WAITING):
            return frozenset(), {}, set()
        key = (
            j,
            p,
            buffers[j],
            tuple(name for name, holder in locks if holder == j),
            tuple(sorted(((w, tuple(sorted(v))) for w, v in env.items()), key=repr)) if env else (),
            tuple(sorted(contended)) if contended else (),
            self.crashes and self._replaces(state, j),
        )
        # A trie of what the simulations from this key read, in the order they read it (fixed
        # by what they saw before): a node is [what it reads next, {seen: node}] or [None, result].
        node = self._simulated.get(key)
        while node is not None and node[0] is not None:
            node = node[1].get(self._read(state, frozen, j, node[0]))
        if node is not None:
            return node[1]
        reads: dict = {}
        result = self._simulate_once(state, j, env, contended, frozen, reads)
        node = self._simulated.setdefault(key, [None, None]) if reads else None
        if node is None:
            self._simulated[key] = [None, result]
            return result
        for what, seen in reads.items():
            if node[0] is None:
                node[0], node[1] = what, {}
            elif node[0] != what:
                raise AssertionError(f"{self.parties[j].name}: two simulations read in different orders")
            node = node[1].setdefault(seen, [None, None])
        node[1] = result
        return result

    def _read(self, state: tuple, frozen: set[int], j: int, what: tuple) -> Any:
        """What a simulation read: a word (its value, or on the weak order the values party ``j``
        may still see), or a lock (free for ``j``, or held by a party that waits)."""
        kind, name = what
        if kind == "m":
            k = self.index[name]
            return state[1][k][state[4][j][k] :] if self.mode == "weak" else state[0][k]
        holder = dict(state[5]).get(name)
        return (holder is None or holder == j, holder in frozen)

    def _simulate_once(self, state: tuple, j: int, env: dict, contended: set, frozen: set[int], reads: dict):
        memory, histories, parties, buffers, views, locks, _ = state
        p = parties[j]
        footprint: set = {("S", w) for w, _ in buffers[j]}  # they still drain
        stores: dict = {}
        for w, v in buffers[j]:
            stores.setdefault(w, set()).add(v)
        taken: set = set()
        holders = dict(locks)
        held = frozenset(name for name, holder in locks if holder == j)
        if self.crashes and p[0] != DONE:
            if self._replaces(state, j):
                return TOP  # its death starts the new writer
            footprint |= {("K", name) for name in held}
        program = self.programs[j]
        start = (p, tuple(sorted(dict(buffers[j]).items(), key=repr)), held)
        seen = {start}
        stack = [start]
        while stack:
            p, overlay, mine = stack.pop()
            if not self._steps(j, p):
                continue
            step = program.step[p]
            if isinstance(step, Load):
                w = step.word
                own = dict(overlay).get(w)
                if own is not None:
                    values = {own}
                else:
                    seen_value = reads[("m", w)] = self._read(state, frozen, j, ("m", w))
                    values = set(seen_value) if self.mode == "weak" else {seen_value}
                extra = env.get(w)
                if extra or own is None:
                    footprint.add(("L", w))
                if extra:
                    values |= extra
                nexts = [(program.after(p, v), overlay, mine) for v in values]
            elif isinstance(step, Store):
                footprint.add(("S", step.word))
                stores.setdefault(step.word, set()).add(step.value)
                new = dict(overlay)
                new[step.word] = step.value
                nexts = [(program.after(p, None), tuple(sorted(new.items(), key=repr)), mine)]
            elif isinstance(step, Choose):
                nexts = [(program.after(p, v), overlay, mine) for v in range(step.options)]
            elif isinstance(step, Fence):
                nexts = [(program.after(p, None), overlay, mine)]
            elif isinstance(step, Lock):
                reads[("l", step.name)] = self._read(state, frozen, j, ("l", step.name))
                holder = holders.get(step.name)
                free = step.name in mine or holder is None or holder == j
                if not free and holder in frozen and step.wait:
                    continue  # it waits for a party that does not move: there it stays
                footprint.add(("K", step.name))
                taken.add(step.name)
                outcomes = [] if not free and holder in frozen else [True]
                if not step.wait and (not free or step.name in contended):
                    outcomes.append(False)
                nexts = [(program.after(p, got), overlay, mine | {step.name} if got else mine) for got in outcomes]
            elif isinstance(step, Unlock):
                footprint.add(("K", step.name))
                nexts = [(program.after(p, None), overlay, mine - {step.name})]
            else:
                raise TypeError(step)
            for nxt in nexts:
                if nxt not in seen:
                    if len(seen) >= SOLO_LIMIT:
                        return TOP
                    seen.add(nxt)
                    stack.append(nxt)
        return frozenset(footprint), stores, taken

    def _perform(self, state: tuple, i: int, step: Any):
        """What party ``i``'s ``step`` can do now: (value sent back, changes, label, footprint)."""
        memory, histories, parties, buffers, views, locks, regions = state
        drained = not buffers[i]
        if isinstance(step, Load):
            own = [v for w, v in buffers[i] if w == step.word]
            if own:
                yield own[-1], {}, (i, "load", step.word, own[-1], "own"), frozenset()
                return
            k = self.index[step.word]
            footprint = frozenset({("L", step.word)})
            if self.mode == "weak":
                history = histories[k]
                for idx in range(views[i][k], len(history)):
                    yield history[idx], {"view": (k, idx)}, (i, "load", step.word, history[idx], ""), footprint
                return
            yield memory[k], {}, (i, "load", step.word, memory[k], ""), footprint
        elif isinstance(step, Store):
            name = step.word[0] if isinstance(step.word, tuple) else step.word
            if name not in self.parties[i].stores:
                raise AssertionError(f"{self.parties[i].name} stores {name!r}, which its Party does not list")
            footprint = frozenset({("S", step.word)}) if self.mode == "sc" else frozenset()
            yield None, {"store": (step.word, step.value)}, (i, "store", step.word, step.value, ""), footprint
        elif isinstance(step, Fence):
            barrier = step.full or self.mode == "weak"
            if self.mode == "sc" or not barrier:
                yield None, {}, (i, "fence", step.full, f" (no barrier in {self.mode})", ""), frozenset()
            elif drained:
                yield None, {"refresh": True}, (i, "fence", step.full, "", ""), frozenset()
        elif isinstance(step, Lock):
            footprint = frozenset({("K", step.name)})
            holder = dict(locks).get(step.name)
            if self.mode == "tso" and not drained:
                return  # a locked instruction: the party's stores reach memory first
            if holder is None:
                yield True, {"lock": step.name, "refresh": True}, (i, "lock", step.name, True, ""), footprint
            elif not step.wait:
                yield False, {"refresh": True}, (i, "lock", step.name, False, ""), footprint
        elif isinstance(step, Unlock):
            if self.mode == "sc" or drained:  # a release: the party's stores reach memory first
                yield None, {"unlock": step.name}, (i, "unlock", step.name, None, ""), frozenset({("K", step.name)})
        elif isinstance(step, Choose):
            for option in range(step.options):
                yield option, {}, (i, "choose", step.why, option, ""), frozenset()
        else:
            raise TypeError(step)

    def _advance(self, state: tuple, i: int, value: Any, effects: dict, label: tuple):
        """Party ``i`` takes a step: the state after it (and after the steps nobody else can tell
        from it), the problem it ran into, and the labels of the steps taken."""
        memory, histories, parties, buffers, views, locks, regions = state
        problem = None
        if "store" in effects:
            word, v = effects["store"]
            if self.mode == "sc":
                state, problem = self._write(state, word, v, i)
            else:
                nb = list(buffers)
                nb[i] = (*buffers[i], (word, v))
                state = (memory, histories, parties, tuple(nb), views, locks, regions)
        if "view" in effects:
            k, idx = effects["view"]
            state = self._with_view(state, i, k, idx)
        if effects.get("refresh") and self.mode == "weak":
            state = self._refresh(state, i)
        if "lock" in effects:
            state = state[:5] + (tuple(sorted((*state[5], (effects["lock"], i)))),) + state[6:]
        if "unlock" in effects:
            state = state[:5] + (tuple(x for x in state[5] if x != (effects["unlock"], i)),) + state[6:]
        program = self.programs[i]
        np = list(state[2])
        np[i] = program.after(parties[i], value)
        state = state[:2] + (tuple(np),) + state[3:]
        state, settled = self._settle(state, (i,))
        problem = problem or settled
        labels = [label]
        while problem is None:  # steps nobody else can tell from the one before: one move
            key = state[2][i]
            if not self._steps(i, key):
                break
            quiet = self._quiet(state, i, program.step[key])
            if quiet is None:
                break
            nxt_key = program.after(key, quiet[0])
            if nxt_key[1]:
                break  # it passes a marker: the state in between stays, for the invariant to see
            np = list(state[2])
            np[i] = nxt_key
            state = state[:2] + (tuple(np),) + state[3:]
            labels.append(quiet[1])
        return state, problem, tuple(labels)

    def _quiet(self, state: tuple, i: int, step: Any) -> tuple[Any, tuple] | None:
        """``(value, label)`` if party ``i``'s ``step`` commutes with every other move and changes
        nothing another party or the invariant reads: a load of a word no other party can store
        any more (nor has a store of in its buffer, nor, on the weak order, an older value this
        party may still read), a load of the party's own buffered store, a store into its own
        buffer, or a fence that is no barrier in this mode."""
        memory, histories, parties, buffers, views, _, _ = state
        if isinstance(step, Fence):
            if self.mode == "sc" or (self.mode == "tso" and not step.full):
                return None, (i, "fence", step.full, "", "")
            return None
        if not isinstance(step, Load):
            return None
        word = step.word
        own = [v for w, v in buffers[i] if w == word]
        if own:
            return own[-1], (i, "load", word, own[-1], "own")
        name = word[0] if isinstance(word, tuple) else word
        for j, p in enumerate(parties):
            if j == i or name not in self.parties[j].stores:
                continue
            if any(w == word for w, _ in buffers[j]):
                return None
            if not (p in (DEAD, WAITING) or p[0] == DONE):
                return None
        k = self.index[word]
        if self.mode == "weak" and views[i][k] != len(histories[k]) - 1:
            return None
        return memory[k], (i, "load", word, memory[k], "")

    def _settle(self, state: tuple, moved) -> tuple[tuple, str | None]:
        """Apply the markers the parties in ``moved`` passed (regions, accepted copies, failures)."""
        problem = None
        regions = list(state[6])
        for i in moved:
            p = state[2][i]
            if p in (DEAD, WAITING):
                continue
            for m in p[1]:
                if isinstance(m, Mark):
                    regions[i] = (m.region, m.slot) if m.slot >= 0 else ()
                elif isinstance(m, Accept):
                    want = m.expected if m.expected is not None else tuple(m.version for _ in m.cells)
                    if tuple(m.cells) != want:
                        problem = problem or (
                            f"{self.parties[i].name} accepted slot {m.slot} as version {m.version}, "
                            f"but its cells hold {list(m.cells)}, not {list(want)}"
                        )
                elif isinstance(m, Fail):
                    problem = problem or f"{self.parties[i].name}: {m.why}"
        return state[:6] + (tuple(regions),), problem

    def _write(self, state: tuple, word: Any, value: int, by: int) -> tuple[tuple, str | None]:
        """Party ``by``'s store of ``value`` into ``word`` reaches memory; the state after, and
        the problem if a word that may only grow went down."""
        memory, histories, parties, buffers, views, locks, regions = state
        k = self.index[word]
        before = memory[k]
        problem = (
            f"{_word(word)} went back from {before} to {value}" if word in self.monotonic and value < before else None
        )
        memory = memory[:k] + (value,) + memory[k + 1 :]
        state = (memory, histories, parties, buffers, views, locks, regions)
        if self.mode != "weak":
            return state, problem
        histories = histories[:k] + (histories[k] + (value,),) + histories[k + 1 :]
        state = (memory, histories, parties, buffers, views, locks, regions)
        return self._with_view(state, by, k, len(histories[k]) - 1), problem  # it never reads older than its own

    def _with_view(self, state: tuple, i: int, k: int, idx: int) -> tuple:
        views = list(state[4])
        v = list(views[i])
        v[k] = idx
        views[i] = tuple(v)
        return self._trim(state[:4] + (tuple(views),) + state[5:], k)

    def _refresh(self, state: tuple, i: int) -> tuple:
        histories, views = state[1], list(state[4])
        views[i] = tuple(len(h) - 1 for h in histories)
        state = state[:4] + (tuple(views),) + state[5:]
        for k in range(len(histories)):
            state = self._trim(state, k)
        return state

    def _trim(self, state: tuple, k: int) -> tuple:
        """Drop values of word ``k`` that no party may read any more (so equal states compare equal)."""
        histories, views = state[1], state[4]
        oldest = min(v[k] for v in views)
        if oldest == 0:
            return state
        histories = histories[:k] + (histories[k][oldest:],) + histories[k + 1 :]
        views = tuple(v[:k] + (v[k] - oldest,) + v[k + 1 :] for v in views)
        return state[:1] + (histories,) + state[2:4] + (views,) + state[5:]

    def _crash(self, state: tuple, i: int) -> Move:
        memory, histories, parties, buffers, views, locks, regions = state
        np = list(parties)
        np[i] = DEAD
        nl = tuple(x for x in locks if x[1] != i)
        nr = list(regions)
        nr[i] = ()
        footprint: frozenset | None = frozenset(("K", name) for name, holder in locks if holder == i)
        nxt = (memory, histories, tuple(np), buffers, views, nl, tuple(nr))
        if not buffers[i] and self._replaces(nxt, i):
            nxt, footprint = self._start_replacement(nxt), TOP  # the new writer's moves come with this one
        return Move(i, ((i, "dies", None, None, ""),), nxt, None, footprint)

    def _replaces(self, state: tuple, i: int) -> bool:
        """Whether the replacement waits for party ``i``, a writer, to die."""
        return self.parties[i].writer and self.replacing is not None and state[2][self.replacing] == WAITING

    def _start_replacement(self, state: tuple) -> tuple:
        np = list(state[2])
        np[self.replacing] = self.programs[self.replacing].start
        return state[:2] + (tuple(np),) + state[3:]

    # -- what the invariant may look at --------------------------------------------------------------
    def word(self, state: tuple, word: Any) -> int:
        return state[0][self.index[word]]

    def regions(self, state: tuple, region: str) -> set[int]:
        """The slots that living parties are in ``region`` of."""
        parties, regions = state[2], state[6]
        return {r[1] for i, r in enumerate(regions) if r and r[0] == region and parties[i] != DEAD}

    def buffered(self, state: tuple, name: str) -> set[Any]:
        """The words named ``name`` that a store in some buffer is still on its way to."""
        return {w for buffer in state[3] for w, _ in buffer if isinstance(w, tuple) and w[0] == name}

    def held(self, state: tuple, lock: str) -> bool:
        return any(name == lock for name, _ in state[5])

    # -- progress: from every state, every living party can still get done -----------------------
    def _finished(self, state: tuple) -> bool:
        for i, p in enumerate(state[2]):
            if p in (DEAD, WAITING) or p[0] == DONE:
                continue
            if self.parties[i].stops and not self._steps(i, p):
                continue  # stopped for good, and allowed to be
            return False
        return not any(state[3])  # and every store drained

    def _check_progress(self, successors: dict, lasting: dict, parent: dict, start: tuple, result: Result) -> None:
        """From every state the parties alive there can all get done, none of them dying."""
        finished = [s for s in successors if self._finished(s)]
        result.schedules = _count_schedules(successors, start, set(finished))
        predecessors: dict[tuple, list[tuple]] = {}
        for s, nexts in lasting.items():
            for t in nexts:
                predecessors.setdefault(t, []).append(s)
        can_finish = set(finished)
        queue = deque(finished)
        while queue:
            for p in predecessors.get(queue.popleft(), ()):
                if p not in can_finish:
                    can_finish.add(p)
                    queue.append(p)
        stuck = {s for s in successors if s not in can_finish}
        if stuck:
            nearest, trace = self._shortest(successors, start, stuck, parent)
            result.failure = "a state from which the parties still alive can never all get done (stuck or livelocked)"
            result.trace = trace + self._describe(nearest)

    # -- reports -----------------------------------------------------------------------------------
    def _trace(self, parent: dict, state: tuple) -> list[str]:
        """The schedule by which ``state`` was first found."""
        steps = []
        while parent.get(state) is not None:
            state, labels = parent[state]
            steps.append(labels)
        return self._numbered(reversed(steps))

    def _shortest(self, successors: dict, start: tuple, targets: set, parent: dict) -> tuple[tuple, list[str]]:
        """The nearest of ``targets`` and the shortest schedule to it among the moves explored."""
        back: dict[tuple, tuple | None] = {start: None}
        queue = deque([start])
        found = start if start in targets else None
        while queue and found is None:
            state = queue.popleft()
            for nxt in successors.get(state, ()):
                if nxt not in back:
                    back[nxt] = state
                    if nxt in targets:
                        found = nxt
                        break
                    queue.append(nxt)
        if found is None:  # a failure found on a move out of a state not expanded yet
            target = next(iter(targets))
            return target, self._trace(parent, target)
        path = [found]
        while back[path[-1]] is not None:
            path.append(back[path[-1]])
        path.reverse()
        steps = []
        for before, after in zip(path, path[1:]):
            steps.append(next(m.label for m in self._all_moves(before) if m.state == after))
        return found, self._numbered(steps)

    def _all_moves(self, state: tuple) -> list[Move]:
        return [m for i in range(len(self.parties)) for m in self.moves_of(state, i)]

    def _numbered(self, steps) -> list[str]:
        return [f"{n}. " + "; ".join(self._render(label) for label in labels) for n, labels in enumerate(steps, 1)]

    def _render(self, label: tuple) -> str:
        i, kind, a, b, note = label
        who = self.parties[i].name
        if kind == "load":
            return f"{who} loads {_word(a)} = {b}" + (" (its own buffered store)" if note else "")
        if kind == "store":
            return f"{who} stores {_word(a)} = {b}" + ("" if self.mode == "sc" else " (into its buffer)")
        if kind == "drain":
            return f"{who}'s buffered store reaches memory: {_word(a)} = {b}"
        if kind == "fence":
            return f"{who}: {'full_fence' if a else 'fence'}{b}"
        if kind == "lock":
            return f"{who} takes the {a} lock" if b else f"{who} finds the {a} lock taken"
        if kind == "unlock":
            return f"{who} releases the {a} lock"
        if kind == "choose":
            return f"{who}: {a}? {'yes' if b else 'no'}"
        return f"{who} dies here"

    def _describe(self, state: tuple) -> list[str]:
        out = []
        for i, p in enumerate(state[2]):
            if p in (DEAD, WAITING) or p[0] == DONE:
                status = p if p in (DEAD, WAITING) else "done"
            else:
                status = f"next: {self.programs[i].step[p]}"
            out.append(f"   {self.parties[i].name}: {status}")
        return ["   then, for good:", *out]


def _conflict(a: frozenset, b: frozenset) -> bool:
    """Whether two footprints touch one word with at least one store, or one lock."""
    if len(a) > len(b):
        a, b = b, a
    for kind, word in a:
        if kind == "S":
            if ("S", word) in b or ("L", word) in b:
                return True
        elif kind == "L":
            if ("S", word) in b:
                return True
        elif (kind, word) in b:
            return True
    return False


def _count_schedules(successors: dict, start: tuple, finished: set) -> int:
    """Maximal schedules: paths from the start to a state where every living party is done and
    nothing is left to do, counted over the state graph without walking them (a back edge, a spin
    that repeats a state, is not followed: each spin counts once)."""
    memo: dict[tuple, int] = {}
    on_path: set[tuple] = {start}
    stack: list[tuple[tuple, int]] = [(start, 0)]
    while stack:
        state, k = stack[-1]
        nexts = successors.get(state, ())
        if k < len(nexts):
            stack[-1] = (state, k + 1)
            t = nexts[k]
            if t not in memo and t not in on_path:
                on_path.add(t)
                stack.append((t, 0))
            continue
        stack.pop()
        on_path.discard(state)
        total = 1 if state in finished and not nexts else 0
        total += sum(memo.get(t, 0) for t in nexts)
        memo[state] = total
    return memo[start]


def _word(word: Any) -> str:
    if isinstance(word, tuple):
        name, *index = word
        return f"{name}[{']['.join(map(str, index))}]"
    return str(word)
