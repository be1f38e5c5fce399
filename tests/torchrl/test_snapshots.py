"""Every version a snapshot: once ``update_policy_weights_(weights)`` returns, the trainer may write
its weights any way, at once, and the next batch still runs exactly the weights sent, whole. With
no weights argument, the next batch runs the trainer's weights as they are when it starts (as
TorchRL's default scheme gives them), whole and under a version of their own.

The policy (:class:`collectors.WeightProbe`) reports, per frame, the smallest and the largest of all
its weights. Each round sets every weight to the round's number ``k``, updates, then writes the
weights again right away (as the next optimizer step, a target-network update or a reset would),
to ``k + 0.5``; the batch after an update with weights must carry ``lo == hi == k`` and the version
tag ``k`` on every frame, the batch after an update without them ``lo == hi == k + 0.5`` under one
new tag: a frame that ran another state, or a mix of the two, shows otherwise.
"""

import threading

import pytest
import torch
from tensordict import TensorDict
from torchrl.collectors import MultiSyncCollector

from shmsync import ShmWeightSyncScheme
from tests.torchrl.collectors import make_pendulum, make_probe_policy

pytestmark = [pytest.mark.slow, pytest.mark.torchrl, pytest.mark.timeout(180)]

ROUNDS = 8
BIG = 1024  # the probe's square parameter: 4 MB of weights


def _devices():
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])]  # fmt: skip


def _set(module: torch.nn.Module, value: float, how: str) -> None:
    """Every weight of ``module`` set to ``value``, written the way ``how`` says."""
    if how == "in place":
        with torch.no_grad():
            for p in module.parameters():
                p.fill_(value)
    elif how == ".data":
        for p in module.parameters():
            p.data.fill_(value)  # no trace in the version counter
    elif how == "load_state_dict":
        module.load_state_dict({k: torch.full_like(v, value) for k, v in module.state_dict().items()})
    else:
        raise ValueError(how)


def _collector(policy, device: str):
    scheme = ShmWeightSyncScheme()
    collector = MultiSyncCollector(
        [make_pendulum] * 2,
        policy,
        frames_per_batch=20,
        total_frames=-1,
        device=device if device != "cpu" else None,
        weight_sync_schemes={"policy": scheme},
    )
    return collector, scheme


def _ran(batch) -> list[tuple[float, float, int]]:
    """The distinct (lowest weight, highest weight, version tag) of the batch's frames."""
    rows = torch.stack([batch["w_lo"].float().cpu(), batch["w_hi"].float().cpu(), batch["policy_version"].float()])
    return sorted({tuple(r) for r in rows.reshape(3, -1).T.tolist()})


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("how", ["in place", ".data", "load_state_dict"])
@pytest.mark.parametrize("whose", ["the trainer's own module", "the collector's policy"])
def test_writing_the_weights_right_after_an_update_never_reaches_its_version(whose, how, device):
    policy = make_probe_policy(big=BIG).to(device)
    collector, scheme = _collector(policy, device)
    # The trainer's own module (a loss module's copy), its weights passed; or the collector's
    # policy itself, updated with no argument.
    own = whose == "the trainer's own module"
    trainer = make_probe_policy(big=BIG).to(device) if own else policy
    weights = TensorDict.from_module(trainer) if own else None
    try:
        it = iter(collector)
        next(it)
        exact, tags = 0, []
        for k in range(1, ROUNDS + 1):
            _set(trainer, float(k), "in place")
            if own:
                collector.update_policy_weights_(weights)
            else:
                collector.update_policy_weights_()
            _set(trainer, k + 0.5, how)  # at once: the next step, before any worker ran version k
            ran = _ran(next(it))
            if own:  # the weights passed, as they were at the call
                assert ran == [(k, k, k)], f"round {k}: the batch after the update ran {ran} (lo, hi, tag)"
            else:  # the trainer's weights as the batch started: the write, whole, under a tag of its own
                assert len(ran) == 1 and ran[0][:2] == (k + 0.5, k + 0.5), f"round {k}: the batch ran {ran}"
                assert ran[0][2] == scheme.version, f"round {k}: tagged {ran[0][2]}, the newest is {scheme.version}"
                tags.append(ran[0][2])
            exact += 1
        # One version a round: an update with no weights is published as the next batch is handed out.
        assert exact == ROUNDS and scheme.version == ROUNDS
        assert tags == sorted(set(tags))
    finally:
        collector.shutdown()


@pytest.mark.parametrize("device", _devices())
def test_a_publisher_thread_beside_the_loop_keeps_every_frame_whole_and_tagged(device):
    """``update_policy_weights_()`` from a second thread, flat out, while the main thread iterates
    (and so publishes at each hand-out what changed, while the other thread writes): every frame
    ran one whole version, each tag one state, later versions later states, each worker's versions
    only go up, and no worker dies."""
    policy = make_probe_policy(big=2048).to(device)  # 16 MB
    collector, scheme = _collector(policy, device)
    stop, errors, sent = threading.Event(), [], [0]

    def publish_flat_out():
        try:
            k = 0
            while not stop.is_set():
                k += 1
                _set(policy, float(k), "in place")
                collector.update_policy_weights_()
                sent[0] = k
        except BaseException as e:  # reported by the test
            errors.append(e)

    publisher = threading.Thread(target=publish_flat_out, name="publisher")
    try:
        it = iter(collector)
        next(it)
        publisher.start()
        seen: dict[int, list[int]] = {}
        held: dict[int, float] = {}
        frames = 0
        for _ in range(20):
            batch = next(it)
            lo, hi = batch["w_lo"].float().cpu(), batch["w_hi"].float().cpu()
            tag = batch["policy_version"].float()
            assert torch.equal(lo, hi), "a frame ran a mix of two versions"
            # One state per tag: the update calls' snapshots, and the hand-outs' (the weights as
            # each batch started, published under versions of their own).
            for v, w in zip(tag.flatten().tolist(), lo.flatten().tolist()):
                assert held.setdefault(v, w) == w, f"frames tagged {v} ran {held[v]} and {w}"
            for w in range(batch.shape[0]):  # MultiSync stacks the workers' frames along dim 0
                seen.setdefault(w, []).extend(batch["policy_version"][w].flatten().tolist())
            frames += batch.numel()
        stop.set()
        publisher.join(30)
        assert not errors, errors
        assert sent[0] >= 5, f"the publisher thread made only {sent[0]} updates"
        for w, versions in seen.items():
            assert versions == sorted(versions), f"worker {w}'s versions went back"
        assert len({v for vs in seen.values() for v in vs}) >= 3, "the workers saw too few versions"
        values = [held[v] for v in sorted(held)]
        assert values == sorted(values), f"a later version held older weights: {held}"
    finally:
        stop.set()
        publisher.join(30)
        collector.shutdown()
