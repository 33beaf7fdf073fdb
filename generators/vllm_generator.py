"""The vLLM generator: managed or external servers, the versions they hold, and restarts.

``rollflow.generators.generator`` says what a generator is and how a version reaches a vLLM
server (in place, merged, or as an adapter); this module does it.

Replicas: ``[rollout].num_generator_replicas`` managed servers of one spec, started together,
each with its share of the generator's cores (``VLLMServerSpec.cpus``) and its own log
(``logs/vllm-server.log``, then ``vllm-server-1.log``, ...). The one ``VLLMPolicy`` deals
episodes to them round robin (every episode records the replica that sampled it); a version
is published to every replica before the call returns, and a failed publish raises, so no
replica serves an older version than the one the policy names. A replica that died is
restarted alone and given what the others hold; the live ones keep serving.

Sleep mode (``VLLMServerSpec.sleep_mode``: a lockstep run whose servers share the trainer's
GPU, ``sleeps_during_updates``). The order, each step: the rollout plays; ``sleep_for_update``
probes the served weights (``probe_logprobs``) and puts every server to sleep
(``POST /sleep``), which frees the GPU for the update (and a local teacher); the update
runs; the next ``policy_for`` wakes them (``POST /wake_up``, after this process's CUDA
cache is emptied so that the memory is there to take back), syncs the version's weights
(reloaded in place even when the same folder was held: a level-2 sleep dropped them), and
checks them: the probe again, whose logprobs must be finite and within
``PROBE_TOLERANCE_NATS`` a token of the ones before the sleep (``weights_problem``), else
``GeneratorError``. This is the guard against sampling from weights the sync never reached
(TRL's issue 5312: rollouts from dropped weights after a level-2 wake). It cannot tell one
update's small move from none: a version whose probe did not move at all is only reported.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from rollflow.config.parsing import ConfigError
from rollflow.config.run import RunConfig
from rollflow.envs.agent import Policy
from rollflow.generators.cpu_split import deal_cores
from rollflow.generators.generator import (
    UNMANAGED_SERVER,
    GeneratorError,
    GeneratorFault,
    run_adapter_prefix,
    sampling_settings,
)
from rollflow.generators.managed_server import (
    ManagedServer,
    ServerHost,
    probe_logprobs,
    server_fault,
    sleep_server,
    wake_server,
    weights_problem,
)
from rollflow.generators.models import base_model_ref, torch_device
from rollflow.policy.models import ModelRef, hf_model_folder, load_tokenizer, stop_token_ids
from rollflow.policy.procs import fault_point
from rollflow.policy.sampling import SamplingSettings
from rollflow.policy.vllm_admin import discover_served_model
from rollflow.policy.vllm_backend import VLLMPolicy, adapter_name
from rollflow.policy.vllm_server import VLLMServer
from rollflow.policy.vllm_spec import ServerDevice, VLLMServerSpec, cuda_dtype, lora_rank_limit, run_api_key
from rollflow.policy.vllm_weights import merge_adapter, untied_serving_folder
from rollflow.storage.runfolder import RunFolder

SERVED_MODEL_NAME = "policy"
VLLM_LOG = Path("logs") / "vllm-server.log"
SERVING_DIR = "serving"  # <run>/serving/policy-v{N}-merged: the version a server reloaded
# One update moves the probe's logprobs by far less (GRPO's ratio clip bounds its move on the
# tokens it trains to about 0.2 nats); weights a sleep dropped give logprobs nats away or NaN.
PROBE_TOLERANCE_NATS = 1.0
PROBE_TEXT = "The weights probe: 12 + 30 = 42, and the capital of France is Paris."


# ---------------------------------------------------------------- vLLM


def serves_in_place(config: RunConfig) -> bool:
    """Whether a managed server gets each version's weights in place (full weights, or
    LoRA merged) rather than as adapters."""
    return not config.train.use_lora or config.rollout.lora_serving == "merged"


class VLLMGenerator:
    """vLLM servers, managed (``server``) or the user's, and the versions they hold."""

    def __init__(
        self, config: RunConfig, folder: RunFolder | None, policy: VLLMPolicy,
        servers: ManagedServer | Sequence[ManagedServer] | None, tokenizer: PreTrainedTokenizerBase,
        *, key: tuple[object, ...],
    ) -> None:  # fmt: skip
        self.config, self.folder, self.policy = config, folder, policy
        self.servers: list[ManagedServer] = (
            [] if servers is None else list(servers) if isinstance(servers, Sequence) else [servers]
        )  # fmt: skip
        self.tokenizer, self.key = tokenizer, key
        self.in_place = bool(self.servers) and serves_in_place(config)
        self.adapters: dict[int, Path] = {}  # adapters: version -> folder, loaded on the servers
        self.weights: tuple[int, Path] | None = None  # in place: the version reloaded (None: the spec's own)
        self._scratch: Path | None = None  # merged folders of a generator without a run folder
        self.closed = False
        # Sleep mode (module docstring): asleep between a rollout and the next policy_for
        spec = self.servers[0].spec if self.servers else None  # None: a server rollflow did not start
        self.sleeps = spec is not None and spec.sleep_mode
        self.asleep = False
        self._weights_dropped = False  # a level-2 wake: the next sync reloads whatever is held
        self._probed: tuple[int, list[list[float]]] | None = None  # (version, each server's probe) before the sleep

    @property
    def server(self) -> ManagedServer | None:
        """The first managed server (the only one without replicas); None: the user's servers."""
        return self.servers[0] if self.servers else None

    def adapter(self, version: int) -> str:
        return adapter_name(run_adapter_prefix(self.folder), version)

    def policy_for(self, version: int, checkpoint: Path | None) -> Policy:
        """The policy acting as ``version``, the one version served (others are unloaded)."""
        waking = self.asleep
        if waking:
            self._wake()
        policy = self.policy
        policy.settings = sampling_settings(self.config)
        if self.in_place:
            self._reload(version, self.serving_folder(version, checkpoint))
        else:
            source = checkpoint if checkpoint is not None else self.config.model.adapter
            if source is None:
                policy.unload_adapter()
                self.adapters.clear()
            else:
                self._check_adapter(Path(source))
                fault_point("weight_publish")  # tests: a kill while the step's weights go to the server
                policy.load_adapter(source, version, self.adapter(version))
                self.adapters = {version: Path(source)}
        policy.version = version
        if waking:
            self._check_weights(version)
        return policy

    # ---- sleep mode

    def sleep_for_update(self) -> None:
        """Probe the weights served, then put every server to sleep until the next
        ``policy_for`` (module docstring); nothing where sleep mode is off."""
        if not self.sleeps or self.asleep:
            return
        self._probed = (self.policy.version, self._probe())
        level = self.servers[0].spec.sleep_level
        for server in self.servers:
            sleep_server(server.base_url, level, api_key=server.spec.api_key)
        self.asleep = True
        print(f"  vLLM: asleep for the update (level {level})", file=sys.stderr, flush=True)

    def _wake(self) -> None:
        _release_cuda_cache()  # the trainer's freed blocks, which the servers take back
        for server in self.servers:
            wake_server(server.base_url, api_key=server.spec.api_key)
        self.asleep = False
        self._weights_dropped = self.servers[0].spec.sleep_level == 2

    def _probe(self) -> list[list[float]]:
        ids = self.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
        model = self.policy.request_model
        return [probe_logprobs(s.base_url, model, ids, api_key=s.spec.api_key) for s in self.servers]

    def _check_weights(self, version: int) -> None:
        """The weights synced after a wake are a policy's (module docstring)."""
        if self._probed is None:
            return
        before_version, before = self._probed
        self._probed = None
        for server, old, new in zip(self.servers, before, self._probe(), strict=True):
            problem = weights_problem(old, new, PROBE_TOLERANCE_NATS)
            if problem is not None:
                raise GeneratorError(
                    f"{server.base_url}: after its wake from sleep mode, version {version}'s weights are not "
                    f"what the server samples from: {problem}. The server's log: {server.log_path}"
                )
            if version != before_version and old == new:
                print(f"  vLLM: version {version}'s probe logprobs equal version {before_version}'s: an update "
                      "below the serving dtype's precision, or weights that were not synced", file=sys.stderr, flush=True)  # fmt: skip

    def publish(self, version: int, checkpoint: Path | None) -> None:
        """``version`` served (None: the run's start): beside the adapters held, or in
        place of the weights. Requests running meanwhile meet either version: the caller
        pauses them first where that matters (``AsyncGenerator``)."""
        if self.in_place:
            self._reload(version, self.serving_folder(version, checkpoint))
        elif checkpoint is not None:
            self._check_adapter(Path(checkpoint))
            fault_point("weight_publish")  # tests: a kill while a new version goes to the server
            self.policy.add_adapter(checkpoint, self.adapter(version))
            self.adapters[version] = Path(checkpoint)
        self.policy.version = version

    def retire(self, version: int) -> None:
        """Unload ``version``'s adapter (no request may still name it)."""
        if self.adapters.pop(version, None) is not None:
            self.policy.remove_adapter(self.adapter(version))

    def versions_read(self) -> set[int]:
        """The versions whose checkpoint folders a restart reads: the adapters loaded, and
        full weights reloaded from their checkpoint (a merged version has its own folder)."""
        read = set(self.adapters.copy())  # published on another thread
        merged = self.folder.root / SERVING_DIR if self.folder is not None else self._scratch
        if self.weights is not None and self.weights[1].parent != merged:
            read.add(self.weights[0])
        return read

    def pinned(self, version: int, seed: int) -> VLLMPolicy:
        """A view that always samples ``version`` (published) from ``seed``."""
        adapter = self.adapter(version) if version in self.adapters else None
        return self.policy.pinned(version, adapter=adapter, seed=seed)

    def fault(self) -> GeneratorFault | None:
        if not self.servers:
            return server_fault(None, self.policy.base_urls)
        for server in self.servers:
            fault = server_fault(server, (server.base_url,))
            if fault is not None:
                return fault
        return None

    def restart(self, reason: str, *, exact: bool = False) -> None:
        """The managed servers that cannot sample (all of them when none is seen failing) on
        fresh processes of their spec, holding what the others hold; a new policy for their
        ports (counters carried over). ``GeneratorError`` for the user's servers.

        Weights held in place whose folder is gone: the servers come back on their spec's own
        weights, which the next ``policy_for`` replaces (lockstep). ``exact``: there is no
        such next call (an async run keeps sampling the version it holds), so this raises
        ``GeneratorError`` before restarting anything rather than serve other weights under
        that version's name."""
        if not self.servers:
            raise GeneratorError(f"{reason}; {UNMANAGED_SERVER}")
        if exact and self.weights is not None and not self.weights[1].is_dir():
            version, folder = self.weights
            raise GeneratorError(
                f"{reason}, and version {version}'s weights ({folder}) are gone: a restarted server "
                "could only serve other weights under its name. Resume the run: it serves the "
                "version of the checkpoints it finds"
            )
        failed = [i for i, s in enumerate(self.servers) if server_fault(s, (s.base_url,)) is not None]
        for i in failed or range(len(self.servers)):
            server = self.servers[i]
            name = "the managed server" if len(self.servers) == 1 else f"replica {i}"
            print(f"  vLLM: restarting {name}: {reason}", file=sys.stderr, flush=True)
            server.restart(reason, log_path=self._log_path(i))
            print(f"  vLLM: restarted, healthy after {server.startup_s:.1f} s", file=sys.stderr, flush=True)
        fresh = [self.servers[i].base_url for i in failed or range(len(self.servers))]
        old = self.policy
        self.policy = managed_policy(self.servers, self.tokenizer, old.settings)
        self.policy.stats, self.policy.version = old.stats, old.version
        # What was held, as far as its folders are left (pruned ones: the next policy_for loads
        # anew); the live replicas hold it already, the fresh ones get it now
        self.adapters = {v: folder for v, folder in self.adapters.items() if folder.is_dir()}
        live = {name: folder for name, folder in old.held_adapters().items() if folder.is_dir()}
        self.policy.adopt_adapters(live, old.adapter_name if old.adapter_name in live else None, only=fresh)
        if self.weights is not None and not self.weights[1].is_dir():
            self.weights = None  # the fresh servers hold their spec's own weights
            if len(fresh) < len(self.servers):  # and so must the live ones
                self.policy.reload_weights(self.servers[0].spec.model_dir, old.version)
        if self.weights is not None:
            self.policy.reload_weights(self.weights[1], self.weights[0], only=fresh)

    def _log_path(self, replica: int) -> Path | None:
        return replica_log(self.folder.root, replica) if self.folder is not None else None

    def close(self) -> None:
        self.closed = True
        for server in self.servers:
            server.stop()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        elif self.folder is not None and self.in_place:  # a cache: rebuilt from the checkpoints
            shutil.rmtree(self.folder.root / SERVING_DIR, ignore_errors=True)

    # ---- in place

    def serving_folder(self, version: int, checkpoint: Path | None) -> Path | None:
        """What the server reloads to serve ``checkpoint`` (None: its spec's own folder)."""
        base = base_model_ref(self.config)
        if checkpoint is None:
            if base.adapter is None:
                return None
            checkpoint = Path(base.adapter)  # the trainer's version 0: base and adapter, merged
        if not (Path(checkpoint) / "adapter_config.json").is_file():
            return Path(checkpoint)  # a full-weight checkpoint
        target = self._serving_dir() / f"policy-v{version}-merged"
        return merge_adapter(ModelRef(path=base.path, gguf_file=base.gguf_file), Path(checkpoint), target)

    def _reload(self, version: int, folder: Path | None) -> None:
        held = self.weights[1] if self.weights is not None else None
        assert self.servers
        if held != folder or self._weights_dropped:
            self._weights_dropped = False
            fault_point("weight_publish")  # tests: a kill while the step's weights go to the server
            seconds = self.policy.reload_weights(folder or self.servers[0].spec.model_dir, version)
            print(f"  vLLM: version {version}'s weights reloaded in place in {seconds:.1f}s", file=sys.stderr, flush=True)
        self.weights = None if folder is None else (version, folder)
        self._forget_merged(keep=folder)

    def _serving_dir(self) -> Path:
        if self.folder is not None:
            return self.folder.root / SERVING_DIR
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="rollflow-serving-"))
        return self._scratch

    def _forget_merged(self, keep: Path | None) -> None:
        """Delete the merged folders the server no longer needs: it holds ``keep``'s weights,
        which a restart reloads; every other version is rebuilt from its checkpoint."""
        if self.folder is None and self._scratch is None:
            return
        for merged in self._serving_dir().glob("policy-v*-merged"):
            if merged != keep:
                shutil.rmtree(merged, ignore_errors=True)
                (merged.parent / f".{merged.name}.lock").unlink(missing_ok=True)  # build_atomically's

    def _check_adapter(self, source: Path) -> None:
        """Only adapters reach the user's servers (a managed one serving adapters trains LoRA)."""
        if not self.servers and not (source / "adapter_config.json").is_file():
            raise ConfigError(
                "[rollout].base_urls: full-weight checkpoints cannot reach external vLLM servers; "
                "train with [train].use_lora = true, or leave base_urls empty for a managed server"
            )


def sleep_for_update(generator: object) -> None:
    """The generator's servers asleep for the update where they share the trainer's GPU
    (``VLLMGenerator.sleep_for_update``); any other generator: nothing."""
    if isinstance(generator, VLLMGenerator):
        generator.sleep_for_update()


def _release_cuda_cache() -> None:
    """Hand this process's cached, unused CUDA blocks back to the driver (a no-op without CUDA)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def server_specs(
    config: RunConfig, *, versions_in_flight: int, cpus: Sequence[int] = ()
) -> tuple[VLLMServerSpec, ...]:
    """One spec per replica (``[rollout].num_generator_replicas``): ``server_spec``'s, with the
    generator's cores (``cpus``; empty: every core this process may use) dealt out
    (``deal_cores``). Replicas on a cluster's nodes are given ``cpus`` whole, and each deals
    its node's share on the node (``cluster/ray_replicas.py``)."""
    spec = server_spec(config, versions_in_flight=versions_in_flight, cpus=cpus)
    n = config.rollout.num_generator_replicas
    if config.cluster.serves_generators or n == 1:
        return (spec,) * n
    cores = tuple(spec.cpus) or tuple(sorted(os.sched_getaffinity(0)))
    return tuple(dataclasses.replace(spec, cpus=deal_cores(cores, i, n)) for i in range(n))


def replica_log(run_root: Path, replica: int) -> Path:
    """``logs/vllm-server.log`` for the first replica, ``logs/vllm-server-<i>.log`` for the others."""
    return run_root / (VLLM_LOG if replica == 0 else VLLM_LOG.with_name(f"vllm-server-{replica}.log"))


def server_spec(config: RunConfig, *, versions_in_flight: int, cpus: Sequence[int] = ()) -> VLLMServerSpec:
    """The managed server of a run: the base model, untied when weights are reloaded in
    place; LoRA flags only when versions reach it as adapters; bound to ``cpus`` (empty:
    every core; an async run passes its split, ``generators/cpu_split.py``)."""
    base = base_model_ref(config)
    model_dir = hf_model_folder(ModelRef(path=base.path, gguf_file=base.gguf_file))
    lora = not serves_in_place(config)
    device = server_device(config)
    rollout = config.rollout
    on_cuda = {} if device == "cpu" else {
        "dtype": cuda_dtype(config.model.dtype, None if config.cluster.serves_generators else local_cuda_capability()),
        "enforce_eager": rollout.enforce_eager,
        "gpu_memory_utilization": rollout.gpu_memory_utilization,
        "tensor_parallel_size": rollout.tensor_parallel_size,
        "sleep_mode": sleeps_during_updates(config),
    }  # fmt: skip
    return VLLMServerSpec(
        model_dir=str(untied_serving_folder(model_dir) if serves_in_place(config) else model_dir),
        served_model_name=config.rollout.api_model or SERVED_MODEL_NAME,
        max_model_len=config.rollout.max_model_length,
        enable_lora=lora,
        max_lora_rank=lora_rank_limit(config.train.lora_rank) if lora else 16,
        max_loras=max(1, versions_in_flight) if lora else 1,
        kvcache_space_gib=config.rollout.vllm_kvcache_space_gib,
        python=config.rollout.vllm_python,
        cpus=tuple(cpus),
        api_key=run_api_key() if config.cluster.serves_generators else None,  # on nodes' addresses
        reloads_in_place=serves_in_place(config),
        device=device,
        **on_cuda,
    )


def server_device(config: RunConfig) -> ServerDevice:
    """Where the run's managed servers run: ``[rollout].vllm_device``, whose "auto" is the
    GPUs of the nodes that ``[cluster].generator_gpus`` places replicas on, else the device
    ``[model].device`` resolves to on this machine (the server is started here). Not the
    driver's device when the replicas run elsewhere."""
    chosen = config.rollout.vllm_device
    if chosen != "auto":
        return chosen
    if config.cluster.serves_generators:
        return "cuda" if config.cluster.generator_gpus > 0 else "cpu"
    return "cuda" if torch_device(config).type == "cuda" else "cpu"


def shares_gpu_with_trainer(config: RunConfig) -> bool:
    """The managed servers and the trainer are on one GPU: both on this machine, the
    server on CUDA, and the trainer's ``[model].device`` one of the first
    ``tensor_parallel_size`` CUDA devices (those a server started here uses)."""
    if config.cluster.serves_generators or config.cluster.trains_on_cluster or server_device(config) != "cuda":
        return False
    trainer = torch_device(config)
    return trainer.type == "cuda" and (trainer.index or 0) < config.rollout.tensor_parallel_size


def sleeps_during_updates(config: RunConfig) -> bool:
    """Sleep mode: the servers share the trainer's GPU and nothing samples during an update
    (lockstep; an async run samples while it trains)."""
    return shares_gpu_with_trainer(config) and config.rollout.max_steps_off_policy is None


def local_cuda_capability() -> tuple[int, int] | None:
    """The compute capability of this machine's first CUDA device, None without one."""
    import torch

    return tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None  # type: ignore[return-value]


def generator_key(config: RunConfig, *, versions_in_flight: int, cpus: Sequence[int] = ()) -> tuple[object, ...]:
    """Equal keys: one generator serves both configs (on the same cores)."""
    rollout = config.rollout
    if rollout.base_urls:
        return ("external", rollout.base_urls, rollout.api_model)
    cluster = config.cluster
    placed = ("placed", cluster.address, cluster.generator_nodes, cluster.generator_gpus, cluster.generator_cpus)
    return ("managed", *server_specs(config, versions_in_flight=versions_in_flight, cpus=cpus), *(placed if cluster.serves_generators else ()))


def start_vllm_generator(
    config: RunConfig, folder: RunFolder | None, *, versions_in_flight: int, host: ServerHost | None = None,
    cpus: Sequence[int] = (),
) -> VLLMGenerator:  # fmt: skip
    """Start the managed servers (or connect to the user's), serving the base model; ``host``
    starts them elsewhere (a Ray cluster's nodes: ``cluster/ray_replicas.py``); ``cpus``: the
    cores they are bound to (empty: every core)."""
    rollout = config.rollout
    base = base_model_ref(config)
    tokenizer = load_tokenizer(ModelRef(path=base.path, gguf_file=base.gguf_file))
    key = generator_key(config, versions_in_flight=versions_in_flight, cpus=cpus)
    if rollout.base_urls:
        served = rollout.api_model or discover_served_model(rollout.base_urls[0])
        policy = VLLMPolicy(
            rollout.base_urls, tokenizer, sampling_settings(config), served_model=served,
            stop_token_ids=stop_token_ids(hf_model_folder(base)),
        )  # fmt: skip
        policy.connect(check_logprobs_mode=True)
        return VLLMGenerator(config, folder, policy, None, tokenizer, key=key)
    specs = [spec for spec in key[1:] if isinstance(spec, VLLMServerSpec)]
    logs = [replica_log(folder.root, i) if folder is not None else None for i in range(len(specs))]
    servers: list[ManagedServer] = (
        [VLLMServer(spec, log_path=log, startup_timeout_s=rollout.vllm_startup_timeout_s) for spec, log in zip(specs, logs)]
        if host is None else host(specs, logs, rollout.vllm_startup_timeout_s)
    )  # fmt: skip
    try:
        start_together(servers)
        policy = managed_policy(servers, tokenizer, sampling_settings(config))
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return VLLMGenerator(config, folder, policy, servers, tokenizer, key=key)


def start_together(servers: Sequence[ManagedServer]) -> None:
    """Start every server, the replicas at once: each spawned here (so that it dies with this
    process, ``VLLMServer.spawn``), then all waited for together. The first failure, or a
    Ctrl-C or SIGTERM while they start, stops every server at once, so that the other waits
    end now rather than at their start-up timeouts (minutes), and raises."""
    what = "the managed vLLM server" if len(servers) == 1 else f"{len(servers)} managed vLLM replicas"
    print(f"  vLLM: starting {what} (tens of seconds on a CPU)", file=sys.stderr, flush=True)
    for server in servers:
        server.spawn()
    if len(servers) == 1:
        servers[0].wait_ready()
    else:
        pool = ThreadPoolExecutor(max_workers=len(servers), thread_name_prefix="vllm-start")
        try:
            for ready in [pool.submit(server.wait_ready) for server in servers]:
                ready.result()
        except BaseException:
            for server in servers:
                server.stop()
            raise
        finally:
            pool.shutdown(wait=True)  # quick: every wait ends once its server is stopped
    slowest = max((t for t in (getattr(s, "startup_s", None) for s in servers) if t is not None), default=None)
    print("  vLLM: serving" + (f" after {slowest:.1f} s" if slowest is not None else ""), file=sys.stderr, flush=True)


def managed_policy(
    servers: ManagedServer | Sequence[ManagedServer], tokenizer: PreTrainedTokenizerBase, settings: SamplingSettings
) -> VLLMPolicy:
    servers = list(servers) if isinstance(servers, Sequence) else [servers]
    spec = servers[0].spec
    policy = VLLMPolicy(
        [server.base_url for server in servers], tokenizer, settings, served_model=spec.served_model_name,
        stop_token_ids=stop_token_ids(Path(spec.model_dir)),
        max_lora_rank=spec.max_lora_rank if spec.enable_lora else None, api_key=spec.api_key,
    )  # fmt: skip
    policy.connect(check_logprobs_mode=False)  # our flags: processed logprobs
    return policy
