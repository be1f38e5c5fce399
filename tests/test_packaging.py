"""What shmsync declares to an index, and what checks its files before an upload: the Pythons named
in pyproject.toml are the ones the Makefile and the GitHub workflow test, and ``.ci/check_dist.py``
(``make dist``'s last check) refuses what PyPI would refuse."""

from __future__ import annotations

import importlib.util
import re

import pytest

from tests.commands import CHECKOUT
from tests.docs.test_facts import _makefile

ROOT = CHECKOUT


def test_the_pythons_named_are_the_pythons_tested():
    pyproject = (ROOT / "pyproject.toml").read_text()
    classifiers = re.findall(r'"Programming Language :: Python :: (3\.\d+)"', pyproject)
    floor = re.search(r'^requires-python = ">=(3\.\d+)"', pyproject, re.M).group(1)
    tested = _makefile()["PYTHONS"].split()
    workflow = (ROOT / ".github" / "workflows" / "ci.yml").read_text()
    matrix = re.findall(r'"(3\.\d+)"', re.search(r"matrix:\n\s+python: \[(.*)\]", workflow).group(1))
    installed = [sorted(block.split()) for block in re.findall(r"python-version: \|\n((?:\s+[\d.]+\n)+)", workflow)]
    assert classifiers == tested, f"pyproject.toml names Pythons {classifiers}, the Makefile tests {tested}"
    assert floor == tested[0], f"requires-python >={floor}, the oldest tested {tested[0]}"
    assert matrix == tested[:-1], f"the workflow's matrix {matrix}: every Python but the newest (make test's)"
    assert installed and all(v == sorted(tested) for v in installed), f"the workflow installs {installed}"


def _check_dist():
    spec = importlib.util.spec_from_file_location("check_dist", ROOT / ".ci" / "check_dist.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "names, problem",
    [
        (["shmsync-0.2.0.tar.gz", "shmsync-0.2.0-cp310-cp310-manylinux_2_17_x86_64.whl",
          "shmsync-0.2.0-cp313-cp313-manylinux1_x86_64.manylinux_2_5_x86_64.whl"], None),
        (["shmsync-0.2.0.tar.gz", "shmsync-0.2.0-cp310-cp310-manylinux_2_17_x86_64.whl",
          "shmsync-0.2.0-cp313-cp313-linux_x86_64.whl"], "is not a manylinux tag"),
        (["shmsync-0.2.0.tar.gz", "shmsync-0.2.0-cp310-cp310-manylinux_2_17_x86_64.whl"], "expected one for each"),
        (["shmsync-0.2.0-cp310-cp310-manylinux_2_17_x86_64.whl",
          "shmsync-0.2.0-cp313-cp313-manylinux_2_17_x86_64.whl"], "one sdist expected"),
        (["shmsync-0.1.0.tar.gz", "shmsync-0.2.0-cp310-cp310-manylinux_2_17_x86_64.whl",
          "shmsync-0.2.0-cp313-cp313-manylinux_2_17_x86_64.whl"], "not shmsync 0.2.0"),
        (["shmsync-0.2.0.tar.gz", "shmsync-0.2.0-cp310-abi3-manylinux_2_17_x86_64.whl",
          "shmsync-0.2.0-cp313-cp313-manylinux_2_17_x86_64.whl"], "not a manylinux tag of one CPython"),
    ],
)  # fmt: skip
def test_make_dist_refuses_what_an_index_refuses(tmp_path, names, problem):
    for name in names:
        (tmp_path / name).write_bytes(b"")
    found = _check_dist().problems(tmp_path, ["3.10", "3.13"], "0.2.0")
    if problem is None:
        assert found == []
    else:
        assert any(problem in p for p in found), found
