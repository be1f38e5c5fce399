"""What ``import shmsync`` sets up in TorchRL: the weight-sync backend registry entry (whichever of
the two is imported first, without loading TorchRL) and the Hydra config entry of config-driven
trainers."""

import subprocess
import sys

import pytest

from shmsync.torchrl.compat import TORCHRL_VERSION

pytestmark = [pytest.mark.torchrl, pytest.mark.timeout(180)]


@pytest.mark.skipif(TORCHRL_VERSION < (0, 14), reason="TorchRL's backend registry came in 0.14")
@pytest.mark.parametrize("first", ["shmsync", "torchrl"])
def test_from_backend_builds_the_scheme_whichever_is_imported_first(first):
    imports = ["import shmsync", "from torchrl.weight_update import WeightSyncScheme"]
    code = "; ".join(imports if first == "shmsync" else imports[::-1]) + (
        "; s = WeightSyncScheme.from_backend('shmsync', num_slots=5, zero_copy=True)"
        "; from shmsync import ShmWeightSyncScheme"
        "; assert type(s) is ShmWeightSyncScheme, type(s)"
        "; assert s.settings.num_slots == 5 and s.settings.zero_copy, vars(s)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.timeout(300)
@pytest.mark.skipif(TORCHRL_VERSION < (0, 14), reason="TorchRL's config-driven trainers came in 0.14")
def test_a_config_driven_trainer_selects_shmsync_by_an_override(tmp_path):
    import json
    import os
    from pathlib import Path

    pytest.importorskip("hydra")
    root = Path(__file__).resolve().parents[1]
    # An editable install serves the hydra_plugins namespace through an import hook that Hydra's
    # plugin scan cannot list; the source tree on the path is what a regular install looks like.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    override = "+weight_sync_scheme@collector.weight_sync_schemes.policy=shmsync"
    proc = subprocess.run(
        [sys.executable, str(root / "tests/hydra_app/train.py"), f"hydra.run.dir={tmp_path}", override],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["schemes"] == {"policy": "ShmWeightSyncScheme"}
    # 6 batches, one publish after each: frames carry the versions as they were published.
    assert result["versions"][0] == 0 and max(result["versions"]) >= 3, result
