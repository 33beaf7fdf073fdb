"""Rollout fan-out over a Ray cluster: a step's chunks as Prefect tasks on the cluster's nodes.

With ``[cluster].mode`` "local" or "address" (lockstep runs, ``[rollout].backend = "vllm"``),
the training flow opens the cluster for the run (``rollout_cluster``) and hands the rollout
stage a ``RayFanOut``. The stage (``tasks/rollout.py``) still holds the run's generator, its
health checks and restarts; only the episode loop moves:

- each missing chunk is one Prefect task (``rollout_chunk``, run by prefect-ray's
  ``RayTaskRunner``), placed round robin over the live nodes with soft affinity
  (``remote_options_on``: on that node while it lives, else anywhere), at most one chunk per
  node at a time (``live_nodes``: the nodes rollflow named, else every live node with a
  CPU, e.g. a cluster started by hand);
- what travels is small and picklable: the config, the run folder's path, the step, split
  and chunk index, and ``VLLMPolicySpec`` (the servers' base URLs, the model name or the
  version's adapter name, the version, the sampling settings, the stop tokens and where
  the tokenizer is). The worker loads the environment and the tokenizer (cached per worker
  process), recomputes the stage's plan, plays the chunk with the chunk's seed against the
  URLs, writes its part file into the run folder (``play_chunk_to_part``: atomic, at the
  path its index fixes) and returns a ``ChunkOutcome`` (the path and counts, never
  episodes). Every node must see the run folder at the same path (a shared filesystem;
  a local cluster shares this machine's disk);
- each episode records the node that played it (``episodes.node``: "head", "worker-1",
  ...; on a cluster rollflow did not start, the Ray node id).

Faults:
- a worker node that dies mid-chunk: Ray runs the chunk again on a surviving node
  (``max_retries`` = ``cluster.ray_nodes.NODE_DEATH_RETRIES``, read at submission); the part
  is written once (a part already there is returned as is), so the step's episodes are
  the same set. When Ray gives up (every attempt's node died), the stage lets the chunks
  in flight finish, then fails with ``RolloutChunkError`` naming the chunk; the resumed run
  replays only the missing chunks (the finished parts are kept);
- a generator that stops answering: a chunk with errored episodes whose worker finds a
  server unhealthy (``GET /health``) is not written; the driver makes its usual decision
  (``RestartBudget.keep``: restart a managed server, or ``GeneratorError`` for the user's)
  and replays the chunk, with the restarted server's URL. Chunks in flight against the old
  URL come back the same way and are replayed too.

Prefect: the chunk tasks report to the flow's Prefect API. Where the flow runs on
Prefect's temporary server (no ``PREFECT_API_URL``), its URL (127.0.0.1 of this machine)
is handed to the workers for the submissions (``_api_for_workers``): enough for a local
cluster; nodes on other machines need ``PREFECT_API_URL`` set to a server they reach.

Simplified, and why:
- One chunk per node at a time: a chunk already plays ``[rollout].concurrency`` episodes at
  once, and the URLs a chunk gets are the ones current when it starts (a restart between
  submission and start would cost a replay).
- No rollflow-side retry of a chunk whose node died: Ray's ``max_retries`` is the one retry
  mechanism (Prefect's task retries would be a second one, and a doubled task run).
"""

from __future__ import annotations

import functools
import sys
import time
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from rollflow.config.parsing import ConfigError
from rollflow.config.run import RunConfig
from rollflow.generators.generator import GeneratorError, RestartBudget
from rollflow.generators.models import base_model_ref
from rollflow.policy.models import ModelRef
from rollflow.policy.sampling import SamplingSettings
from rollflow.storage.runfolder import RunFolder
from rollflow.tasks.rollout import ChunkOutcome, play_chunk_to_part
from rollflow.tasks.rollout_plan import StagePlan

if TYPE_CHECKING:
    from prefect_ray import RayTaskRunner
    from transformers import PreTrainedTokenizerBase

    from rollflow.cluster.ray_nodes import RayNode
    from rollflow.generators.policy_io import ActingPolicy
    from rollflow.policy.vllm_backend import VLLMPolicy


class RolloutChunkError(RuntimeError):
    """A chunk played on the cluster failed (Ray gave up on it, or it raised)."""


@dataclass(frozen=True)
class VLLMPolicySpec:
    """What a worker needs to sample a step's version from the generator's servers."""

    base_urls: tuple[str, ...]
    served_model: str
    adapter: str | None  # the version's adapter name on the servers; None: the served model
    version: int
    settings: SamplingSettings
    stop_token_ids: tuple[int, ...]
    tokenizer: ModelRef
    api_key: str | None = field(default=None, repr=False)  # the servers' (VLLMServerSpec.api_key)

    @staticmethod
    def of(config: RunConfig, policy: object) -> VLLMPolicySpec:
        from rollflow.policy.vllm_backend import VLLMPolicy

        if not isinstance(policy, VLLMPolicy):
            raise ConfigError(
                f"rollouts on a Ray cluster ([cluster].mode = {config.cluster.mode!r}) sample a vLLM "
                f"generator over HTTP; this stage acts with a {type(policy).__name__}: use "
                "[rollout].backend = 'vllm', or [cluster].mode = 'none'"
            )
        base = base_model_ref(config)
        return VLLMPolicySpec(
            base_urls=tuple(policy.base_urls), served_model=policy.served_model, adapter=policy.adapter_name,
            version=policy.version, settings=policy.settings,
            stop_token_ids=tuple(sorted(policy.codec.stop_token_ids)),
            tokenizer=ModelRef(path=base.path, gguf_file=base.gguf_file), api_key=policy.api_key,
        )  # fmt: skip

    def policy(self) -> VLLMPolicy:
        from rollflow.policy.vllm_backend import VLLMPolicy

        policy = VLLMPolicy(
            self.base_urls, _tokenizer(self.tokenizer), self.settings, served_model=self.served_model,
            version=self.version, stop_token_ids=self.stop_token_ids, api_key=self.api_key,
        )  # fmt: skip
        policy.adapter_name = self.adapter
        return policy

    def server_problem(self) -> str | None:
        """Why one of the servers cannot sample now, as a worker sees it (None: all answer)."""
        from rollflow.generators.managed_server import server_fault

        fault = server_fault(None, self.base_urls)
        return None if fault is None else fault.describe()


@functools.lru_cache(maxsize=4)
def _tokenizer(ref: ModelRef) -> PreTrainedTokenizerBase:
    from rollflow.policy.models import load_tokenizer

    return load_tokenizer(ref)  # once per worker process: Ray reuses its workers


def live_nodes() -> list[RayNode]:
    """The nodes chunks are dealt to, by name: those rollflow named (a local cluster), else
    every live node of the cluster (named by Ray's node id); only nodes with a CPU."""
    import ray

    from rollflow.cluster.ray_nodes import RayNode, ray_nodes

    nodes = list(ray_nodes().values()) or [
        RayNode(info["NodeID"], info["NodeID"], True, float(info.get("Resources", {}).get("CPU", 0.0)))
        for info in ray.nodes()
        if info["Alive"]
    ]
    return sorted((node for node in nodes if node.cpus >= 1), key=lambda node: node.name)


def this_node() -> str:
    """The name of the Ray node this worker runs on: rollflow's ("head", "worker-1", ...),
    else Ray's node id."""
    import ray

    from rollflow.cluster.ray_nodes import ray_nodes

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray_nodes().values():
        if node.node_id == node_id:
            return node.name
    return node_id


@task(
    name="rollout-chunk", task_run_name="rollout {split} step {step} chunk {index}",
    cache_policy=NO_CACHE, persist_result=False,
)  # fmt: skip
def rollout_chunk(config: RunConfig, run_dir: str, step: int, split: str, index: int, spec: VLLMPolicySpec) -> ChunkOutcome:
    """One chunk, on a Ray worker: played against ``spec``'s servers, its part written."""
    folder = RunFolder(Path(run_dir))
    return play_chunk_to_part(config, folder, step, split, index, spec.policy(), this_node(), spec.server_problem)


class RayFanOut:
    """Plays a rollout stage's missing chunks over the cluster at ``address`` (the module
    docstring says how); ``tasks.rollout.ChunkFanOut``."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._turn = 0  # round robin over the nodes, across the run's stages

    def play_chunks(
        self, config: RunConfig, folder: RunFolder, step: int, split: str, plan: StagePlan,
        missing: list[int], acting: ActingPolicy, budget: RestartBudget,
    ) -> None:  # fmt: skip
        import ray
        from prefect_ray.context import remote_options

        from rollflow.cluster import ray_nodes
        from rollflow.cluster.ray_nodes import remote_options_on

        pending = deque(missing)
        inflight: dict[Any, tuple[int, Any]] = {}  # Ray object ref -> (chunk index, Prefect future)
        failures: list[BaseException] = []
        replays: Counter[int] = Counter()
        done, started = len(plan.chunks) - len(missing), time.perf_counter()
        with stage_task_runner(self.address) as runner:
            try:
                while pending or inflight:
                    nodes = live_nodes()
                    while pending and not failures and len(inflight) < max(1, len(nodes)):
                        index = pending.popleft()
                        node = nodes[self._turn % len(nodes)] if nodes else None
                        self._turn += 1
                        spec = VLLMPolicySpec.of(config, acting.policy)
                        with remote_options(**remote_options_on(node, retries=ray_nodes.NODE_DEATH_RETRIES)):
                            future = runner.submit(rollout_chunk, {
                                "config": config, "run_dir": str(folder.root.absolute()), "step": step,
                                "split": split, "index": index, "spec": spec,
                            })  # fmt: skip
                        inflight[future.wrapped_future] = (index, future)
                    if not inflight:
                        break
                    ready, _ = ray.wait(list(inflight), num_returns=1)
                    index, future = inflight.pop(ready[0])
                    label = plan.label(split, step, index)
                    try:
                        outcome = future.result()
                        if outcome.path is None:  # errored on a server that stopped answering
                            replays[index] += 1
                            if replays[index] > budget.limit + 1:
                                raise GeneratorError(f"{label}: {outcome.problem} (replayed {budget.limit + 1} times)")
                            budget.keep(acting, outcome.errored, outcome.total, f"{label} on {outcome.node}")
                            pending.appendleft(index)  # replayed with the (restarted) server's URL
                            continue
                        # every episode written, but the server may have died since: restarted now
                        budget.keep(acting, 0, outcome.total, f"{label} on {outcome.node}")
                    except (GeneratorError, RolloutChunkError) as error:
                        failures.append(error)
                        continue
                    except Exception as error:  # noqa: BLE001 - named with its chunk, raised below
                        failures.append(_chunk_error(label, error))
                        continue
                    done += 1
                    _progress(split, step, done, len(plan.chunks), started, outcome.node)
            except BaseException:
                for ref in inflight:  # interrupted: nothing of this stage keeps running
                    ray.cancel(ref, force=True)
                raise
        if failures:
            raise failures[0]


def _chunk_error(label: str, error: BaseException) -> RolloutChunkError:
    import ray

    from rollflow.cluster import ray_nodes

    if isinstance(error, ray.exceptions.RayError):
        return RolloutChunkError(
            f"{label} was lost: Ray gave up on it after {ray_nodes.NODE_DEATH_RETRIES + 1} attempt(s) "
            f"(max_retries = {ray_nodes.NODE_DEATH_RETRIES}; the node each ran on died): "
            f"{type(error).__name__}: {(str(error).splitlines() or [''])[0].rstrip('.')}. The chunks "
            "finished are kept: resume the run and only the missing chunks are replayed"
        )
    return RolloutChunkError(f"{label} failed on the cluster: {type(error).__name__}: {error}")


def _progress(split: str, step: int, done: int, total: int, started: float, node: str | None) -> None:
    elapsed = time.perf_counter() - started
    print(f"  rollout {split} step {step}: chunk {done}/{total} on {node} ({elapsed:.1f}s)", file=sys.stderr, flush=True)


@contextmanager
def stage_task_runner(address: str) -> Iterator[RayTaskRunner]:
    """prefect-ray's task runner on the cluster at ``address``, for a stage (the rollout
    chunks, the train stage) to submit its Ray tasks as the flow's task runs, reporting to
    the flow's Prefect API."""
    from rollflow.cluster.ray_nodes import task_runner

    with task_runner(address) as runner, _api_for_workers(), _outside_the_stage_task():
        yield runner


@contextmanager
def _outside_the_stage_task() -> Iterator[None]:
    """Submit as the flow, not as the stage's task run: prefect-ray ships the current task
    run's context (its parameters: the generator, a live server handle) to every worker,
    which cannot be pickled. The submitted tasks are the flow run's task runs."""
    from prefect.context import TaskRunContext

    token = TaskRunContext.__var__.set(None)  # type: ignore[arg-type]
    try:
        yield
    finally:
        TaskRunContext.__var__.reset(token)


@contextmanager
def _api_for_workers() -> Iterator[None]:
    """The flow's Prefect API for the chunk tasks: where no ``PREFECT_API_URL`` is set (the
    flow runs on Prefect's temporary server), that server's URL for the submissions, which
    carry the settings to the workers; else nothing to do."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    if PREFECT_API_URL.value():
        yield
        return
    from prefect.server.api.server import SubprocessASGIServer

    running = [server for server in SubprocessASGIServer._instances.values() if server.running]
    with temporary_settings(updates={PREFECT_API_URL: running[0].api_url}) if running else nullcontext():
        yield


# ---------------------------------------------------------------- the run's cluster


def node_import_env() -> dict[str, str]:
    """The environment that makes a local node's workers import what this process imports:
    this rollflow (its folder first) and the working directory's modules (an environment
    module beside the config)."""
    import importlib.util
    import os

    spec = importlib.util.find_spec("rollflow")  # where it is, without importing its public API
    assert spec is not None and spec.origin is not None, "rollflow is not installed"
    root = str(Path(spec.origin).resolve().parent.parent)
    paths = [os.getcwd(), root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


@contextmanager
def rollout_cluster(config: RunConfig) -> Iterator[RayFanOut | None]:
    """The run's cluster (``[cluster]``), open while the ``with`` lasts, as a fan-out for the
    rollout stage; None for mode "none" (nothing of Ray imported). A local cluster is
    always stopped at the end; an existing one is only left."""
    if config.cluster.mode == "none":
        yield None
        return
    from rollflow.cluster.ray_cluster import open_cluster

    opened = open_cluster(config.cluster, env=node_import_env())
    assert opened is not None
    with opened as cluster:
        names = sorted(cluster.nodes())
        print(f"  cluster: {config.cluster.mode} at {cluster.address}, nodes {names}", file=sys.stderr, flush=True)
        yield RayFanOut(cluster.address)
