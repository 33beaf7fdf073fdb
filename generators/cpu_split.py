"""Async on the CPU: the generator's cores and the trainer's, apart.

In an async run the managed vLLM server samples while the trainer trains, in one machine's
cores. Left alone, both run one OpenMP thread per core, and their threads (which spin while
they wait) take the cores from each other: the train stage runs several times slower
beside the sampling server than split (README, "splits the cores").

``async_cpu_split(config)`` gives the server the first half of the cores this process may
use and the trainer as many threads as the other half has (``trainer_threads``). Only the
server's threads are bound (``VLLMServerSpec.cpus``); the trainer's are not, and the
kernel's scheduler puts them where the bound server leaves room. It applies to an async run
(``[rollout].max_steps_off_policy``) on a managed vLLM server (no ``base_urls``) with the
trainer on the CPU, at least two cores, and both on this machine: neither placed on a node
of a remote cluster (``[cluster].mode = "address"``; a local cluster's nodes share this
machine's cores, so the split stands there). ``[rollout].split_cpus = false`` turns it off.
Lockstep runs never sample and train at once, so each side there has every core.

The split is the async schedule's alone: ``run_async_training`` asks for it and passes the
server's cores to the generator it opens. A generator opened for anything else (a resumed
run's last validation, an evaluation, the pipeline's champion check) gets every core, even
for an async config.

Replicas share their cores: those started here are dealt the server's cores (``deal_cores``),
and those started on a cluster node deal that node's among the replicas placed on it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from rollflow.config.run import RunConfig


def async_cpu_split(config: RunConfig) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(the server's cores, the trainer's cores), or None where nothing is split."""
    rollout = config.rollout
    if not rollout.split_cpus or rollout.max_steps_off_policy is None:
        return None
    if rollout.backend != "vllm" or rollout.base_urls:
        return None  # no managed server beside the trainer
    cluster = config.cluster
    if cluster.mode != "local" and (cluster.serves_generators or cluster.trains_on_cluster):
        return None  # one of them runs on another machine's cores
    if _trainer_device(config) != "cpu":
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return tuple(cores[:half]), tuple(cores[half:])


def deal_cores(cores: Sequence[int], index: int, count: int) -> tuple[int, ...]:
    """Replica ``index`` of ``count`` sharing ``cores``: every ``count``-th core from its
    index; all of them when there are fewer cores than replicas (they share)."""
    if count <= 1 or len(cores) < count:
        return tuple(cores)
    return tuple(cores[index::count])


def _trainer_device(config: RunConfig) -> str:
    from rollflow.generators.models import torch_device

    return torch_device(config).type


@contextmanager
def trainer_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``count`` while open (None: left as they are)."""
    if count is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
