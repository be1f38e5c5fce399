"""What `make dist` built, checked as a package index takes it: ``python .ci/check_dist.py DIST PYTHONS...``.

DIST must hold the sdist and exactly one wheel for each Python named (``3.10`` -> ``cp310``), all of
one version (shmsync's ``__version__``), each wheel with a platform tag PyPI accepts from Linux: a
``manylinux`` one (PyPI refuses the plain ``linux_x86_64`` a compiler's build is tagged with).
Prints what it checked; exits 1 naming each problem.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from packaging.utils import parse_sdist_filename, parse_wheel_filename

MANYLINUX = re.compile(r"manylinux(1|2010|2014|_\d+_\d+)_\w+")


def problems(dist: Path, pythons: list[str], version: str) -> list[str]:
    """What is wrong with the files in ``dist`` (nothing: an empty list)."""
    found = []
    sdists = sorted(dist.glob("*.tar.gz"))
    wheels = sorted(dist.glob("*.whl"))
    others = sorted(p.name for p in dist.iterdir() if p not in sdists and p not in wheels)
    if others:
        found.append(f"files that are neither the sdist nor a wheel: {others}")
    if len(sdists) != 1:
        found.append(f"one sdist expected, found {[p.name for p in sdists]}")
    for sdist in sdists:
        name, sdist_version = parse_sdist_filename(sdist.name)
        if name != "shmsync" or str(sdist_version) != version:
            found.append(f"{sdist.name}: not shmsync {version}")
    wanted = {f"cp{p.replace('.', '')}" for p in pythons}
    seen: dict[str, str] = {}
    for wheel in wheels:
        name, wheel_version, _, tags = parse_wheel_filename(wheel.name)
        if name != "shmsync" or str(wheel_version) != version:
            found.append(f"{wheel.name}: not shmsync {version}")
        for tag in tags:
            if tag.abi != tag.interpreter or not MANYLINUX.fullmatch(tag.platform):
                found.append(f"{wheel.name}: tag {tag} is not a manylinux tag of one CPython (PyPI refuses it)")
            if tag.interpreter in seen and seen[tag.interpreter] != wheel.name:
                found.append(f"two wheels for {tag.interpreter}: {seen[tag.interpreter]} and {wheel.name}")
            seen[tag.interpreter] = wheel.name
    if set(seen) != wanted:
        found.append(f"wheels for {sorted(seen)}, expected one for each of {sorted(wanted)}")
    return found


def main() -> int:
    dist, pythons = Path(sys.argv[1]), sys.argv[2:]
    text = (Path(__file__).resolve().parents[1] / "shmsync" / "__init__.py").read_text()
    version = re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)
    wrong = problems(dist, pythons, version)
    for line in wrong:
        print(f"make dist: {line}", file=sys.stderr)
    if not wrong:
        files = sorted(p.name for p in dist.iterdir())
        print(f"make dist: shmsync {version}, the sdist and {len(pythons)} manylinux wheels: {files}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
