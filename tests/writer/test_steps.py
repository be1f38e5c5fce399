"""How much training each version had seen: the optimizer steps taken on a store's weights,
counted as they happen, recorded with each version, and read back by the readers' table and by
``staleness(..., unit="optim_steps")``."""

import threading

import pytest
import torch
from tensordict import TensorDict

from shmsync import WeightReader, WeightStore, staleness
from shmsync.errors import ArgumentTypeError, InvalidArgumentError


def _step(optimizer: torch.optim.Optimizer, module: torch.nn.Module, n: int = 1) -> None:
    for _ in range(n):
        optimizer.zero_grad()
        module(torch.ones(1, module.in_features)).sum().backward()
        optimizer.step()


def test_only_the_steps_of_optimizers_holding_the_published_weights_count(store_factory):
    policy, critic = torch.nn.Linear(3, 2), torch.nn.Linear(3, 1)
    store = store_factory(policy)
    actor_opt = torch.optim.Adam(policy.parameters(), 1e-3)
    critic_opt = torch.optim.Adam(critic.parameters(), 1e-3)
    _step(critic_opt, critic, 5)
    assert store.steps == 0
    _step(actor_opt, policy, 2)
    assert store.steps == 2
    # A loss module's own parameters over the same memory (TorchRL's losses hold such copies).
    shared = [torch.nn.Parameter(p.data) for p in policy.parameters()]
    shared_opt = torch.optim.SGD(shared, lr=0.1)
    for p in shared:
        p.grad = torch.ones_like(p)
    shared_opt.step()
    assert store.steps == 3


def test_each_version_keeps_the_steps_it_had_seen_here_and_for_other_processes(store_factory):
    policy = torch.nn.Linear(3, 2)
    store = store_factory(policy)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    versions = {}
    for n in range(1, 100):
        _step(optimizer, policy)
        versions[store.publish(policy)] = n
    assert all(store.steps_of(v) == n for v, n in versions.items())
    attached = WeightStore.attach(store.name)  # what another process reads: the header's ring
    try:
        assert attached.steps == 99
        assert attached.steps_of(99) == 99 and attached.steps_of(36) == 36
        assert attached.steps_of(35) is None  # 64 versions back: out of the ring
        assert store.steps_of(7) == 7  # the writer's own record keeps more
    finally:
        attached.close()


def test_the_readers_table_says_how_many_steps_behind_each_reader_runs(store_factory):
    policy = torch.nn.Linear(3, 2)
    store = store_factory(policy)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    reader = WeightReader(store, torch.nn.Linear(3, 2))
    reader.poll()
    assert store.readers()[0].steps_behind == 0
    _step(optimizer, policy, 3)
    (row,) = store.readers()
    assert (row.behind, row.steps_behind) == (0, 3)  # no version behind, three steps of training missed
    store.publish(policy)
    assert store.readers()[0].steps_behind == 3
    reader.poll()
    assert store.readers()[0].steps_behind == 0
    assert "STEPS BEHIND" in store.readers().format()


def test_staleness_in_optimizer_steps(store_factory):
    policy = torch.nn.Linear(3, 2)
    store = store_factory(policy)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
    _step(optimizer, policy, 2)
    v = store.publish(policy)
    _step(optimizer, policy, 3)
    batch = TensorDict({"policy_version": torch.tensor([0, v, v])}, batch_size=[3])
    assert staleness(batch, store, unit="optim_steps").tolist() == [5, 3, 3]
    assert staleness(batch, store).tolist() == [1, 0, 0]
    with pytest.raises(InvalidArgumentError, match="no longer known"):
        staleness(TensorDict({"policy_version": torch.tensor([99])}, batch_size=[1]), store, unit="optim_steps")
    with pytest.raises(ArgumentTypeError, match="needs the store or the scheme"):
        staleness(batch, 5, unit="optim_steps")
    with pytest.raises(InvalidArgumentError, match="unit must be"):
        staleness(batch, store, unit="seconds")


def test_steps_on_several_threads_all_count_and_a_closed_store_stops_counting():
    policy = torch.nn.Linear(3, 2)
    store = WeightStore.create(policy)
    try:
        optimizers = [torch.optim.SGD(policy.parameters(), lr=0.0) for _ in range(4)]
        for p in policy.parameters():
            p.grad = torch.zeros_like(p)
        threads = [threading.Thread(target=lambda o=o: [o.step() for _ in range(250)]) for o in optimizers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert store.steps == 1000
    finally:
        store.close()
    optimizers[0].step()  # the closed store's counter is gone: nothing raised, nothing counted
