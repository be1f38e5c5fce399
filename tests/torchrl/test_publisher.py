"""What version a collector's publish gets (``shmsync/torchrl/publisher.py``), source by source, on
a real store: the version given, the trainer's number of the push a remote node applies (a Ray
actor's, ``shmsync/torchrl/remote_nodes.py``), or the store's next.

End to end, on real collectors: the given version in
``tests/torchrl/test_scheme.py::test_update_policy_weights_with_a_version_tags_frames_with_it``, the next
one everywhere, the trainer's numbers of the pushes in ``tests/torchrl/test_distributed.py`` and
``tests/torchrl/test_ray.py``.
"""

import threading

import pytest
from torch import nn

from shmsync import ShmSyncError
from shmsync.torchrl.publisher import Publisher
from shmsync.torchrl.remote_nodes import ActorPushes, Announced
from shmsync.torchrl.store_group import StoreGroup


@pytest.fixture
def group():
    group = StoreGroup([{"policy": nn.Linear(2, 2)}], num_slots=3, num_workers=2)
    yield group
    group.close()


def publisher_of(group: StoreGroup, pushes=None) -> Publisher:
    publisher = Publisher(pushes=pushes)
    publisher.add(group, "policy_version")
    return publisher


def test_a_given_version_wins(group):
    pushes = ActorPushes()
    pushes.name(3)
    publisher_of(group, pushes).route({"policy": None}, given=9)
    assert group.version == 9
    assert pushes.take() == 3, "a given version takes no push number"


def test_without_a_remote_leg_the_store_counts(group):
    publisher = publisher_of(group)
    publisher.route({"policy": None})
    publisher.route({"policy": None})
    assert group.version == 2


def test_a_remote_leg_publishes_each_push_under_the_trainers_number(group):
    pushes = ActorPushes()
    publisher = publisher_of(group, pushes)
    for number in (1, 2, 5, 6):  # the trainer's numbers skip what went to other actors
        pushes.name(number)
        publisher.route({"policy": None})
        assert group.version == number


def test_a_push_the_trainer_did_not_name_is_refused_not_guessed(group):
    pushes = ActorPushes()
    publisher = publisher_of(group, pushes)
    with pytest.raises(ShmSyncError, match=r"named no version for it.*shmsync\.torchrl\.distributed\.RayCollector"):
        publisher.route({"policy": None})
    pushes.name(4)
    publisher.route({"policy": None})
    assert group.version == 4
    with pytest.raises(ShmSyncError, match="named no version"):
        publisher.route({"policy": None})  # a second push under the same number: never reused
    assert group.version == 4


def test_the_latest_name_counts_and_names_cross_threads():
    announced = Announced()
    thread = threading.Thread(target=lambda: [announced.name(n) for n in range(1, 101)])
    thread.start()
    thread.join()
    assert announced.take() == 100
