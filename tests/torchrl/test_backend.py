"""shmsync by name in TorchRL: the ``"shmsync"`` weight-sync backend (made when shmsync's scheme is
imported, whichever of the two comes first; ``import shmsync`` alone changes nothing in TorchRL)
and the Hydra config entry of config-driven trainers."""

from pathlib import Path

import pytest

from shmsync.torchrl.compat import TORCHRL_VERSION
from tests.commands import python, run_command

pytestmark = [pytest.mark.slow, pytest.mark.torchrl, pytest.mark.timeout(180)]


@pytest.mark.minors  # its outcome depends on TorchRL's release: it runs under every older minor too
@pytest.mark.skipif(TORCHRL_VERSION < (0, 14), reason="TorchRL's backend registry came in 0.14")
@pytest.mark.parametrize("first", ["shmsync", "torchrl"])
def test_from_backend_builds_the_scheme_whichever_is_imported_first(first):
    imports = ["import shmsync.torchrl.scheme", "from torchrl.weight_update import WeightSyncScheme"]
    code = "; ".join(imports if first == "shmsync" else imports[::-1]) + (
        "; s = WeightSyncScheme.from_backend('shmsync', num_slots=5, zero_copy=True)"
        "; from shmsync import ShmWeightSyncScheme"
        "; assert type(s) is ShmWeightSyncScheme, type(s)"
        "; assert s.settings.num_slots == 5 and s.settings.zero_copy, vars(s)"
    )
    run_command(python("-c", code), check=True, timeout=120)


@pytest.mark.skipif(TORCHRL_VERSION < (0, 14), reason="TorchRL's backend registry came in 0.14")
def test_import_shmsync_alone_adds_no_backend():
    code = (
        "import shmsync, sys; from torchrl.weight_update import weight_sync_schemes as w"
        "; assert 'shmsync' not in w._WEIGHT_SYNC_SCHEMES, sorted(w._WEIGHT_SYNC_SCHEMES)"
        "; assert not [m for m in sys.modules if m.startswith('shmsync.torchrl')], 'shmsync.torchrl imported'"
    )
    run_command(python("-c", code), check=True, timeout=120)


@pytest.mark.shipped
@pytest.mark.timeout(300)
@pytest.mark.skipif(TORCHRL_VERSION < (0, 14), reason="TorchRL's config-driven trainers came in 0.14")
def test_a_config_driven_trainer_selects_shmsync_by_an_override(tmp_path):
    """TorchRL's config-driven DQN trainer, its weight-sync scheme chosen on the command line by
    name, as installed: Hydra finds shmsync's config entry through its plugin scan, with nothing
    on PYTHONPATH (an editable install here, the wheel and the sdist in the shipped legs)."""
    import json
    import os
    from pathlib import Path

    pytest.importorskip("hydra")
    app = Path(__file__).resolve().parent / "hydra_app" / "train.py"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    override = "+weight_sync_scheme@collector.weight_sync_schemes.policy=shmsync"
    proc = run_command(python(str(app), f"hydra.run.dir={tmp_path}", override), cwd=tmp_path, env=env, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["schemes"] == {"policy": "ShmWeightSyncScheme"}
    # 6 batches, one publish after each: frames carry the versions as they were published.
    assert result["versions"][0] == 0 and max(result["versions"]) >= 3, result


def test_the_hydra_config_says_the_python_defaults():
    """Every value the config group names is ShmWeightSyncScheme's own default: a config-driven
    trainer gets what `ShmWeightSyncScheme()` gives."""
    import inspect

    import yaml

    import shmsync
    from shmsync import ShmWeightSyncScheme

    path = Path(shmsync.__file__).parent / "conf" / "weight_sync_scheme" / "shmsync.yaml"
    config = yaml.safe_load(path.read_text())
    assert config.pop("_target_") == "shmsync.ShmWeightSyncScheme"
    defaults = {k: p.default for k, p in inspect.signature(ShmWeightSyncScheme.__init__).parameters.items()}
    assert {k: defaults.get(k, "not an argument") for k in config} == config
