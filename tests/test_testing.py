"""The pytest plugin's fixtures, as a user's suite requests them."""

import pytest

pytest_plugins = ["pytester"]


@pytest.mark.slow
def test_leak_check_works_whatever_the_fixture_order(pytester):
    pytester.makepyfile(
        """
        import torch
        from shmsync import WeightStore

        def test_factory_first(store_factory, shm_leak_check):
            assert store_factory(torch.nn.Linear(4, 2)).version == 0

        def test_leak_check_first(shm_leak_check, store_factory):
            assert store_factory(torch.nn.Linear(4, 2)).version == 0

        def test_a_leak_is_caught(shm_leak_check):
            WeightStore.create(torch.nn.Linear(4, 2), unlink_at_exit=False).close()
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_a_leak_is_caught*", "shared-memory stores left behind*"])
