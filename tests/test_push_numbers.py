"""What version a collector's publish gets (``shmsync/torchrl/push_numbers.py``), source by source.

The sources end to end, on real collectors: the given version in
``tests/test_scheme.py::test_update_policy_weights_with_a_version_tags_frames_with_it``, the next
one everywhere, the trainer's numbers of the pushes in ``tests/test_distributed.py`` and
``tests/test_ray.py``.
"""

import threading

import pytest

from shmsync import ShmSyncError
from shmsync.torchrl.push_numbers import Announced, VersionSource


def test_a_given_version_wins():
    announced = Announced()
    announced.name(3)
    assert VersionSource().decide(given=9) == 9
    assert VersionSource(announced).decide(given=9) == 9
    assert announced.take() == 3, "a given version takes no push number"


def test_without_a_remote_leg_the_store_counts():
    assert VersionSource().decide(given=None) is None


def test_a_remote_leg_publishes_each_push_under_the_trainers_number():
    announced = Announced()
    source = VersionSource(announced)
    for number in (1, 2, 5, 6):  # the trainer's numbers skip what went to other actors
        announced.name(number)
        assert source.decide(given=None) == number


def test_a_push_the_trainer_did_not_name_is_refused_not_guessed():
    announced = Announced()
    source = VersionSource(announced)
    with pytest.raises(ShmSyncError, match=r"named no version for it.*shmsync\.torchrl\.distributed\.RayCollector"):
        source.decide(given=None)
    announced.name(4)
    assert source.decide(given=None) == 4
    with pytest.raises(ShmSyncError, match="named no version"):
        source.decide(given=None)  # a second push under the same number: never reused


def test_the_latest_name_counts_and_names_cross_threads():
    announced = Announced()
    thread = threading.Thread(target=lambda: [announced.name(n) for n in range(1, 101)])
    thread.start()
    thread.join()
    assert announced.take() == 100
