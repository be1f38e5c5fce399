"""tag_versions: each frame records the version of the weights that produced it, and a key written
by someone else is left alone."""

import pytest
import torch


def test_a_version_key_written_by_someone_else_is_left_whole_with_one_warning():
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule

    from shmsync import tag_versions

    class FloatVersion(torch.nn.Module):
        def forward(self, obs):
            return obs.sum(-1, keepdim=True), torch.full(obs.shape[:-1], 0.5)

    policy = TensorDictModule(FloatVersion(), in_keys=["obs"], out_keys=["action", "policy_version"])
    tag_versions(policy, lambda: 7)
    with pytest.warns(UserWarning, match="frames already carry 'policy_version'.*version_key='shmsync_version'"):
        out = policy(TensorDict({"obs": torch.ones(3, 2)}, [3]))
    assert out["policy_version"].dtype == torch.float32 and (out["policy_version"] == 0.5).all()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once only
        policy(TensorDict({"obs": torch.ones(3, 2)}, [3]))
    # A key of its own: both tags, side by side.
    tag_versions(policy, lambda: 7, key="shmsync_version")
    out = policy(TensorDict({"obs": torch.ones(3, 2)}, [3]))
    assert out["shmsync_version"].tolist() == [7, 7, 7] and (out["policy_version"] == 0.5).all()
