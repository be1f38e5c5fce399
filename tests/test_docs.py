"""Every Python block of the README and of the docs runs as written; the API reference names
every public name.

The pages leave a few names to the reader (``make_env``, ``policy``, ``train_on``, ``trainer``);
the harness defines them, small, in a module beside each block (importable by name, as Ray's
workers need), and runs each block as its own script (spawned children included), or under
pytest when it is a test.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

DEFINITIONS = '''
"""What the documentation's code blocks leave to their reader, defined small by tests/test_docs.py."""


def make_env():
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1")


def train_on(batch):
    pass


def make_policy():
    from torchrl.modules import MLP, QValueActor

    return QValueActor(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"],
                       spec=make_env().action_spec)


def make_trainer(policy):
    import torch
    from torchrl.collectors import Collector
    from torchrl.objectives import DQNLoss
    from torchrl.trainers import Trainer

    collector = Collector(make_env, policy, frames_per_batch=50, total_frames=200)
    loss = DQNLoss(policy, action_space=make_env().action_spec, delay_value=False)
    return Trainer(collector=collector, total_frames=200, frame_skip=1, optim_steps_per_batch=5,
                   loss_module=loss, optimizer=torch.optim.Adam(loss.parameters(), 1e-3), progress_bar=False)
'''

PRELUDE = """
# --- what the block leaves to its reader (tests/test_docs.py) ---
from block_definitions import make_env, train_on

if __name__ == "__main__":
    if NEEDS_POLICY:
        from block_definitions import make_policy

        policy = make_policy()
    if NEEDS_TRAINER:
        from block_definitions import make_trainer

        trainer = make_trainer(policy)
# --- the block ---
"""


def _blocks() -> list[tuple[str, str, str]]:
    """``(page, section title, code)`` of every ```python block, in order."""
    out = []
    for page in PAGES:
        section = "top"
        for part in re.split(r"(^```python\n.*?^```$)", page.read_text(), flags=re.S | re.M):
            if part.startswith("```python"):
                out.append((page.name, section, part.split("\n", 1)[1].rsplit("```", 1)[0]))
            else:
                titles = re.findall(r"^#+ (.+)$", part, flags=re.M)
                section = titles[-1] if titles else section
    return out


def _uses(name: str, code: str) -> bool:
    """Whether ``code`` uses ``name`` without defining it."""
    assigned = re.search(rf"^\s*{name}\s*=(?!=).*[^,\s]\s*$", code, flags=re.M)  # not a keyword argument
    return bool(re.search(rf"\b{name}\b", code)) and not assigned


def _marks(code: str) -> list:
    marks = []
    if "torchrl" in code or any(_uses(name, code) for name in ("make_env", "policy", "trainer")):
        # The pages show the newest torchrl, and each such block builds a collector: slow, and
        # not a leg's test (the legs run what is marked torchrl).
        marks.append(pytest.mark.slow)
    if re.search(r"\bray\b|Distributed|RelaySender", code):
        marks.append(pytest.mark.distributed)
    return marks


BLOCKS = _blocks()


def test_the_pages_have_their_blocks():
    pages = {page for page, _, _ in BLOCKS}
    assert {"README.md", "getting-started.md", "torchrl.md", "hosts.md"} <= pages, pages
    assert len(BLOCKS) >= 10


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "page, title, code",
    [
        pytest.param(page, title, code, marks=_marks(code), id=re.sub(r"\W+", "-", f"{page[:-3]}-{title}").strip("-"))
        for page, title, code in BLOCKS
    ],
)
def test_a_block_runs_as_written(request, tmp_path, page, title, code):
    if re.search(r"\bray\b", code):
        request.getfixturevalue("one_ray_cluster")  # one Ray cluster at a time
    (tmp_path / "block_definitions.py").write_text(DEFINITIONS)
    if re.search(r"^def test_", code, flags=re.M):
        path = tmp_path / "test_block.py"
        path.write_text(code)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]
    else:
        path = tmp_path / "block.py"
        needs_trainer = _uses("trainer", code)
        prelude = PRELUDE.replace("NEEDS_POLICY", str(_uses("policy", code) or needs_trainer))
        path.write_text(prelude.replace("NEEDS_TRAINER", str(needs_trainer)) + code)
        cmd = [sys.executable, str(path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=280, env=env)
    assert proc.returncode == 0, f"{page}, {title!r}: the block failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_the_api_reference_names_every_public_name():
    import shmsync
    import shmsync.errors

    api = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"\bshmsync\.(\w+)", api))
    errors = {name for name in vars(shmsync.errors) if name[0].isupper() and name != "annotations"}
    missing = sorted(set(shmsync.__all__) - documented - errors)
    assert missing == [], f"public names missing from docs/api.md: {missing}"
    assert ".. automodule:: shmsync.errors" in api
