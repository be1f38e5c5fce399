"""Which TorchRL releases shmsync supports (shmsync/torchrl/releases.py), told from a version
string alone, and the one place the tested nightly is written."""

import pytest

from shmsync.torchrl import releases
from tests.commands import CHECKOUT, run_command


@pytest.mark.parametrize("version", ["0.11.1", "0.12.0", "0.13.2", "0.14.1", "0.15.0", "0.15.0rc1+cpu"])
def test_the_supported_minors_are_let_in(version):
    assert releases.refusal(version) is None


@pytest.mark.parametrize("version", ["0.10.1", "0.16.0", "1.0.0", "", "garbage", "9" * 40])
def test_other_releases_are_refused_saying_what_to_install(version):
    why = releases.refusal(version)
    assert why is not None and "Install a torchrl in that range" in why and f"this is torchrl {version}." in why


def test_a_nightly_counts_as_the_next_minor_from_the_tested_date_on():
    year, month, day = releases.NIGHTLY_TESTED
    assert releases.minor(releases.NIGHTLY) == releases.NIGHTLY_MINOR
    assert releases.minor(f"{year}.{month}.{day + 1}") == releases.NIGHTLY_MINOR
    older = f"{year}.{month}.{day - 1}"
    assert releases.minor(older) is None
    assert "Update the nightly" in releases.refusal(older)


def test_the_makefile_installs_the_nightly_named_here():
    """NIGHTLY is written in releases.py alone: the Makefile's nightly leg reads it from there."""
    make = run_command(
        ["make", "-s", "-f", "Makefile", "-f", "-", "print-nightly"],
        input="print-nightly:\n\t@echo $(TORCHRL_NIGHTLY)\n",
        cwd=CHECKOUT,
        check=True,
    )
    assert make.stdout.strip() == releases.NIGHTLY, make.stdout + make.stderr
