"""Every Python block of the README runs as written.

The README leaves a few names to the reader (``make_env``, ``policy``, ``train_on``,
``trainer``); the harness defines them, small, in a prelude, and runs each block as its own
script (spawned children included), or under pytest when it is a test.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"

PRELUDE = """
# --- placeholders the README leaves to its reader, defined by tests/test_readme.py ---
def make_env():
    from torchrl.envs import GymEnv

    return GymEnv("CartPole-v1")


def train_on(batch):
    pass


def _policy():
    from torchrl.modules import MLP, QValueActor

    return QValueActor(MLP(in_features=4, out_features=2, num_cells=[16]), in_keys=["observation"],
                       spec=make_env().action_spec)


def _trainer(policy):
    import torch
    from torchrl.collectors import Collector
    from torchrl.objectives import DQNLoss
    from torchrl.trainers import Trainer

    collector = Collector(make_env, policy, frames_per_batch=50, total_frames=200)
    loss = DQNLoss(policy, action_space=make_env().action_spec, delay_value=False)
    return Trainer(collector=collector, total_frames=200, frame_skip=1, optim_steps_per_batch=5,
                   loss_module=loss, optimizer=torch.optim.Adam(loss.parameters(), 1e-3), progress_bar=False)


if __name__ == "__main__":
    policy = _policy()
    if NEEDS_TRAINER:
        trainer = _trainer(policy)
# --- the README block ---
"""


def _blocks() -> list[tuple[str, str]]:
    """``(section title, code)`` of every ```python block, in order."""
    out, section = [], "top"
    for part in re.split(r"(^```python\n.*?^```$)", README.read_text(), flags=re.S | re.M):
        if part.startswith("```python"):
            out.append((section, part.split("\n", 1)[1].rsplit("```", 1)[0]))
        else:
            titles = re.findall(r"^#+ (.+)$", part, flags=re.M)
            section = titles[-1] if titles else section
    return out


BLOCKS = _blocks()


def test_the_readme_has_its_blocks():
    assert len(BLOCKS) >= 5, [title for title, _ in BLOCKS]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("title, code", BLOCKS, ids=[re.sub(r"\W+", "-", t).strip("-") for t, _ in BLOCKS])
def test_readme_block_runs_as_written(tmp_path, title, code):
    if re.search(r"^def test_", code, flags=re.M):
        path = tmp_path / "test_block.py"
        path.write_text(code)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]
    else:
        path = tmp_path / "block.py"
        path.write_text(PRELUDE.replace("NEEDS_TRAINER", str("trainer" in code)) + code)
        cmd = [sys.executable, str(path)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"README block under {title!r} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
