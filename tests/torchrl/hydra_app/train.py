"""TorchRL's config-driven DQN trainer entry point (as in sota-implementations/dqn_trainer),
which also writes what the test checks: the versions the collected frames carry, and frames/s."""

import json
import time

import hydra
from torchrl.trainers.algorithms.configs import *  # noqa: F401, F403  (TorchRL's config store)


@hydra.main(config_path="config", config_name="config", version_base="1.3")
def main(cfg):
    trainer = hydra.utils.instantiate(cfg.trainer)
    versions = set()

    def record(batch):
        tag = batch.get("policy_version", None)  # absent with TorchRL's own schemes
        versions.update(tag.unique().tolist() if tag is not None else [])

    trainer.register_op("batch_process", record)
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    schemes = getattr(trainer.collector, "_weight_sync_schemes", None) or {}
    with open("result.json", "w") as f:
        json.dump(
            {
                "versions": sorted(versions),
                "frames_per_second": cfg.collector.total_frames / seconds,
                "schemes": {k: type(v).__name__ for k, v in schemes.items()},
            },
            f,
        )
    trainer.collector.shutdown()


if __name__ == "__main__":
    main()
