"""How ``VLLMPolicy`` loads LoRA adapters (``policy/vllm_backend.py``), against a small HTTP
server that keeps adapters by name as vLLM 0.32's ``/v1/load_lora_adapter`` does
(``entrypoints/openai/models/serving.py``): a name loaded without ``load_inplace`` is
refused while it is loaded; a request stored with ``load_inplace`` makes the engine read
the folder again at every step, so an adapter must be loaded once, not in place.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from rollflow.generators.generator import run_adapter_prefix
from rollflow.policy.vllm_admin import VLLMPolicyError
from rollflow.policy.vllm_backend import VLLMPolicy, adapter_name
from rollflow.storage.runfolder import RunFolder


class AdapterServer(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.loras: dict[str, str] = {}
        self.posts: list[tuple[str, dict[str, object]]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(BaseHTTPRequestHandler):
    server: AdapterServer

    def log_message(self, *_: object) -> None:
        pass

    def _answer(self, status: int, payload: object) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        models = [{"id": "policy", "parent": None}]
        models += [{"id": name, "root": path, "parent": "policy"} for name, path in self.server.loras.items()]
        self._answer(200, {"data": models})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.posts.append((self.path, body))
        name = body["lora_name"]
        if self.path.endswith("/load_lora_adapter"):
            if not body.get("load_inplace") and name in self.server.loras:
                self._answer(400, {"error": {"message": f"The lora adapter '{name}' has already been loaded."}})
                return
            self.server.loras[name] = body["lora_path"]
        elif name not in self.server.loras:
            self._answer(404, {"error": {"message": f"The lora adapter '{name}' cannot be found."}})
            return
        else:
            del self.server.loras[name]
        self._answer(200, "Success")


@pytest.fixture
def server() -> Iterator[AdapterServer]:
    server = AdapterServer()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    thread.join()


def _adapter(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))
    return folder


def _loads(server: AdapterServer) -> list[dict[str, object]]:
    return [body for path, body in server.posts if path.endswith("/load_lora_adapter")]


def test_an_adapter_is_loaded_once_and_never_in_place(
    server: AdapterServer, bundled_tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    policy = VLLMPolicy([server.url], bundled_tokenizer, served_model="policy")
    adapter = _adapter(tmp_path / "checkpoint-0")
    for _ in range(2):  # lockstep loads a step's version for its validation and its rollout
        policy.load_adapter(adapter, 1, "policy-run-v1")
    assert [(b["lora_name"], b["load_inplace"]) for b in _loads(server)] == [("policy-run-v1", False)]
    assert policy.request_model == "policy-run-v1"


def test_a_name_loaded_from_another_folder_is_replaced_not_refused(
    server: AdapterServer, bundled_tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    first, second = _adapter(tmp_path / "a"), _adapter(tmp_path / "b")
    VLLMPolicy([server.url], bundled_tokenizer, served_model="policy").add_adapter(first, "policy-run-v0")
    resumed = VLLMPolicy([server.url], bundled_tokenizer, served_model="policy")  # a later process of the run
    resumed.add_adapter(second, "policy-run-v0")
    assert server.loras == {"policy-run-v0": str(second.resolve())}
    resumed.add_adapter(first, "policy-run-v0")  # this process's own, from another folder
    assert server.loras == {"policy-run-v0": str(first.resolve())}
    assert all(body["load_inplace"] is False for body in _loads(server))


def test_a_refused_load_still_names_the_server_and_the_adapter(
    server: AdapterServer, bundled_tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    policy = VLLMPolicy([server.url], bundled_tokenizer, served_model="policy")
    with pytest.raises(VLLMPolicyError, match="not a peft LoRA adapter folder"):
        policy.add_adapter(tmp_path / "missing", "policy-run-v0")


def test_two_runs_on_one_server_keep_their_own_adapters(
    server: AdapterServer, bundled_tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    """Two runs (or `rollflow eval --adapter` beside a run) on one external server: each
    version of each is its own name, and moving to the next version unloads only its own."""
    runs = [RunFolder(tmp_path / "nightly" / "run"), RunFolder(tmp_path / "manual" / "run")]
    policies = [VLLMPolicy([server.url], bundled_tokenizer, served_model="policy") for _ in runs]
    for version in (1, 2):
        for k, (run, policy) in enumerate(zip(runs, policies, strict=True)):
            adapter = _adapter(tmp_path / f"run{k}-checkpoint-{version}")
            policy.load_adapter(adapter, version, adapter_name(run_adapter_prefix(run), version))
    assert len(server.loras) == 2, server.loras
    assert {policy.request_model for policy in policies} == set(server.loras)
    assert all(name.startswith("policy-run-") and name.endswith("-v2") for name in server.loras)
