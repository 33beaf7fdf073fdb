"""The run's Ray cluster as the training flow holds it: the rollout fan-out and the remote trainer.

Opened before the run's generator and closed after it (``flows/train.py``), so managed
vLLM replicas placed on the cluster's nodes (``ray_replicas.replica_host``) start on a
cluster that is there and are stopped before it goes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from rollflow.config.run import RunConfig

if TYPE_CHECKING:
    from rollflow.cluster.ray_rollout import RayFanOut
    from rollflow.cluster.ray_trainer import RayTrainer


@contextmanager
def run_cluster(config: RunConfig) -> Iterator[tuple[RayFanOut | None, RayTrainer | None]]:
    """The run's Ray cluster, for ``[cluster].mode`` "local" or "address": the rollout
    stage's fan-out (``cluster/ray_rollout.py``) and, where ``[cluster]`` places the trainer
    on it, the train stage's (``cluster/ray_trainer.py``); (None, None), and no Ray imported,
    for "none"."""
    if config.cluster.mode == "none":
        yield None, None
        return
    from rollflow.cluster.ray_rollout import rollout_cluster
    from rollflow.cluster.ray_trainer import cluster_trainer

    with rollout_cluster(config) as fan_out:
        assert fan_out is not None
        yield fan_out, cluster_trainer(config, fan_out.address)
