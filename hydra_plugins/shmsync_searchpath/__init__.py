"""Hydra finds this plugin by itself (the ``hydra_plugins`` namespace): it adds shmsync's
configs to every Hydra app's search path, so TorchRL's config-driven trainers take

    +weight_sync_scheme@collector.weight_sync_schemes.policy=shmsync

with no file written and no import by the user (fields: ``poll_every_steps``, ``version_key``,
``num_slots``, ``zero_copy``, ``per_worker_weights``)."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class ShmSyncSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="shmsync", path="pkg://shmsync.conf")
