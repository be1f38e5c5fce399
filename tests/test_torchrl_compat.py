"""No single TorchRL call path carries the guarantee: remove each hook shmsync installs, as a
TorchRL change would, and the workers still load every published version, or the failure is
loud. And every TorchRL internal shmsync touches lives in one module, checked at first use."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torchrl.collectors import MultiSyncCollector

from shmsync import ShmSyncError, ShmWeightSyncScheme
from shmsync import _torchrl_compat as compat

from helpers import fill, make_pendulum, make_probe_policy

pytestmark = [pytest.mark.torchrl, pytest.mark.timeout(240)]
ROOT = Path(__file__).resolve().parents[1]


def loads_every_version(collector, policy, batches: int = 5) -> None:
    """Publish a new version before each batch; each batch must run it, whole, tagged with it."""
    it = iter(collector)
    next(it)
    for version in range(1, batches + 1):
        fill(policy, version)
        collector.update_policy_weights_()
        batch = next(it)
        assert torch.equal(batch["w_lo"], batch["w_hi"]), "a frame ran a mix of two versions"
        assert (batch["w_lo"] == version).all(), f"a worker ran {batch['w_lo'].unique().tolist()}, not {version}"
        assert (batch["policy_version"] == version).all(), f"frames tagged {batch['policy_version'].unique()}"


def probe_collector(policy, **kwargs):
    return MultiSyncCollector(
        [make_pendulum] * 2,
        policy,
        frames_per_batch=40,
        total_frames=-1,
        weight_sync_schemes={"policy": ShmWeightSyncScheme()},
        **kwargs,
    )


def test_workers_load_every_version_when_their_rollout_cannot_be_wrapped():
    """TorchRL no longer calling ``self.rollout()``: the policy's own check reloads."""
    import helpers

    policy = make_probe_policy()
    fill(policy, 0)
    collector = probe_collector(policy, collector_class=helpers.RolloutCannotBeShadowed)
    try:
        loads_every_version(collector, policy)
    finally:
        collector.shutdown()


def test_workers_load_and_tag_every_version_when_the_policys_hooks_never_run():
    """TorchRL calling the policy without its module hooks: the poll before each rollout
    reloads, and the rollout's frames are tagged with the version it polled."""
    import helpers

    policy = make_probe_policy()
    fill(policy, 0)
    collector = probe_collector(policy, collector_class=helpers.PolicyHooksBypassed)
    try:
        loads_every_version(collector, policy)
    finally:
        collector.shutdown()


def test_workers_load_every_version_without_the_collector_method_wrappers():
    """The update, shutdown and restore wrappers removed from the collector: each update still
    publishes (key by key), and the workers load it."""
    policy = make_probe_policy()
    fill(policy, 0)
    collector = probe_collector(policy)
    for method in ("update_policy_weights_", "shutdown", "load_state_dict"):
        assert method in vars(collector), f"shmsync did not wrap {method}: the test removes nothing"
        delattr(collector, method)
    try:
        loads_every_version(collector, policy)
    finally:
        collector.shutdown()


class _NeverReceived(ShmWeightSyncScheme):
    """The scheme as a TorchRL that stopped setting schemes up in its workers would leave it."""

    def _init_on_receiver_impl(self, *args, **kwargs):
        pass

    def _setup_connection_and_weights_on_receiver_impl(self, *args, **kwargs):
        pass


def test_workers_the_scheme_never_reached_fail_the_first_update_loudly(monkeypatch):
    from shmsync import _scheme_sender

    monkeypatch.setattr(_scheme_sender, "ATTACH_PATIENCE", 2.0)
    try:
        collector = MultiSyncCollector(
            [make_pendulum] * 2,
            make_probe_policy(),
            frames_per_batch=40,
            total_frames=-1,
            weight_sync_schemes={"policy": _NeverReceived()},
        )
    except (RuntimeError, AttributeError) as e:
        # torchrl <= 0.12 cannot even build its workers without the scheme: loud already.
        assert compat.TORCHRL_VERSION < (0, 13), f"the collector failed to build: {e}"
        return
    try:
        with pytest.raises(ShmSyncError, match=r"only 0 of the 2 worker readers attached .*first weights forever"):
            collector.update_policy_weights_()
    finally:
        collector.shutdown()


# -- the compatibility module -----------------------------------------------------------------------
def test_a_torchrl_outside_the_tested_range_is_refused_at_import_with_a_clear_message():
    code = "import torchrl; torchrl.__version__ = '0.15.0'; import shmsync.scheme"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "shmsync supports torchrl 0.11 to 0.14, each minor tested; this is torchrl 0.15.0" in proc.stderr


def test_an_internal_found_otherwise_names_itself_the_torchrl_and_the_versions_that_work():
    class Changed:
        _weight_sync_schemes = 5  # say, a list in a future torchrl

    compat._checked.discard("MultiCollector._weight_sync_schemes")
    with pytest.raises(compat.TorchRLChangedError) as info:
        compat.schemes_of(Changed())
    message = str(info.value)
    assert "'MultiCollector._weight_sync_schemes'" in message and "checked on torchrl 0.11-0.14" in message
    assert f"installed torchrl {compat.torchrl.__version__}" in message and "it is a int" in message


def test_every_internal_is_documented_and_used_and_no_other_module_walks_the_stack():
    sources = {p: p.read_text() for p in (ROOT / "shmsync").glob("*.py")}
    for name in compat.INTERNALS:
        uses = sum(text.count(name) for text in sources.values())
        assert uses >= 2, f"{name!r} is documented but checked nowhere"
    offenders = [
        f"{p.name}:{i + 1}"
        for p, text in sources.items()
        if p.name != "_torchrl_compat.py"
        for i, line in enumerate(text.splitlines())
        if re.search(r"_getframe|__dict__\[", line)
    ]
    assert offenders == [], f"TorchRL internals outside _torchrl_compat.py: {offenders}"
    docs = (ROOT / "docs" / "torchrl.md").read_text()
    missing = [name for name in compat.INTERNALS if f"`{name}`" not in docs]
    assert missing == [], f"internals the docs' TorchRL page does not list: {missing}"
