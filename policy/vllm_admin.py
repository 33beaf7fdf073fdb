"""The vLLM server's HTTP endpoints besides completions: the model list, adapters, weights, caches.

``rollflow.policy.vllm_backend.VLLMPolicy`` (its ``connect``, adapter and reload methods)
and the server teacher (``rollflow.policy.teacher``) call these; each raises
``VLLMPolicyError`` naming the URL, what was asked and, for the admin endpoints, the server
setting that enables them. A connection error or timeout is not retried here. ``api_key``:
the managed server's key (``VLLMServerSpec.api_key``), sent as a bearer token; None for none.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx

from rollflow.policy.retries import server_error_message
from rollflow.policy.session import GenerationError

ADMIN_TIMEOUT_S = 60.0
_CONNECT_TIMEOUT_S = 10.0


class VLLMPolicyError(GenerationError):
    """A vLLM server refused, failed or is unfit; the message names the URL and the reason."""


def api_root(base_url: str) -> str:
    """``http://h:p``, ``http://h:p/`` or ``http://h:p/v1`` -> ``http://h:p/v1``."""
    if not base_url.startswith(("http://", "https://")):
        raise VLLMPolicyError(f"base_url must start with http:// or https://, got {base_url!r}")
    root = base_url.rstrip("/")
    return root if root.endswith("/v1") else root + "/v1"


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header that carries ``api_key`` to a vLLM server (``--api-key``), none without one."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def discover_served_model(base_url: str) -> str:
    """The one base model (not a LoRA adapter) ``base_url`` serves; else name it in api_model."""
    url = api_root(base_url)
    response = _get_models(url)
    try:
        bases = [str(e["id"]) for e in response.json()["data"] if e.get("parent") is None]
    except (ValueError, KeyError, TypeError) as error:
        raise VLLMPolicyError(f"{url}/models is not an OpenAI model list: {response.text[:300]!r}") from error
    if len(bases) != 1:
        raise VLLMPolicyError(f"{url} serves base models {bases}: name the one to use in [rollout].api_model")
    return bases[0]


def _get_models(url: str, api_key: str | None = None) -> httpx.Response:
    try:
        response = httpx.get(f"{url}/models", timeout=_CONNECT_TIMEOUT_S, headers=auth_headers(api_key))
    except httpx.HTTPError as error:
        raise VLLMPolicyError(f"{url} does not answer: {type(error).__name__}: {error}") from error
    if response.status_code != 200:
        raise VLLMPolicyError(f"{url}/models answered HTTP {response.status_code}: {server_error_message(response)}")
    return response


def served_models(url: str, *, api_key: str | None = None) -> dict[str, int | None]:
    """``GET /models``: served name -> max_model_len (None when the server does not say)."""
    response = _get_models(url, api_key)
    try:
        entries = response.json()["data"]
        return {str(e["id"]): e.get("max_model_len") for e in entries}
    except (ValueError, KeyError, TypeError) as error:
        raise VLLMPolicyError(f"{url}/models is not an OpenAI model list: {response.text[:300]!r}") from error


_LORA_HINT = "does the server run with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True?"
DEV_HINT = "does the server run with VLLM_SERVER_DEV_MODE=1? managed servers do"


def admin_post(
    url: str, body: dict[str, Any], *, what: str, hint: str = _LORA_HINT, api_key: str | None = None
) -> None:
    try:
        response = httpx.post(url, json=body, timeout=ADMIN_TIMEOUT_S, headers=auth_headers(api_key))
    except httpx.HTTPError as error:
        raise VLLMPolicyError(f"{url}: {what} failed: {type(error).__name__}: {error}") from error
    if response.status_code != 200:
        raise VLLMPolicyError(
            f"{url}: {what} failed, HTTP {response.status_code}: {server_error_message(response)} ({hint})"
        )


def reset_prefix_cache(root: str, attempts: int = 20, *, api_key: str | None = None) -> None:
    """``POST /reset_prefix_cache`` until it answers ``success`` (it refuses while blocks are busy)."""
    for _ in range(attempts):
        try:
            response = httpx.post(f"{root}/reset_prefix_cache", timeout=ADMIN_TIMEOUT_S, headers=auth_headers(api_key))
        except httpx.HTTPError as error:
            raise VLLMPolicyError(f"{root}: resetting the prefix cache failed: {error}") from error
        if response.status_code != 200:
            raise VLLMPolicyError(
                f"{root}: resetting the prefix cache failed, HTTP {response.status_code}: "
                f"{server_error_message(response)} ({DEV_HINT})"
            )
        if response.json().get("success"):
            return
        time.sleep(0.25)
    raise VLLMPolicyError(f"{root}: the prefix cache would not reset (requests still running?)")


def load_lora(url: str, name: str, adapter: Path, *, api_key: str | None = None) -> None:
    """Load ``adapter`` as ``name`` on one server, not in place. A name the server already
    holds (loaded by an earlier process of the same run) is unloaded and loaded again."""
    body = {"lora_name": name, "lora_path": str(adapter), "load_inplace": False}
    what = f"loading adapter {adapter} as {name}"
    try:
        admin_post(f"{url}/load_lora_adapter", body, what=what, api_key=api_key)
    except VLLMPolicyError:
        if name not in served_models(url, api_key=api_key):  # refused for another reason: that error stands
            raise
        unload_lora(url, name, api_key=api_key)
        admin_post(f"{url}/load_lora_adapter", body, what=what, api_key=api_key)


def unload_lora(url: str, name: str, *, api_key: str | None = None) -> None:
    admin_post(f"{url}/unload_lora_adapter", {"lora_name": name}, what=f"unloading {name}", api_key=api_key)


def adapter_rank(adapter: Path) -> int:
    try:
        return int(json.loads((adapter / "adapter_config.json").read_text())["r"])
    except (OSError, ValueError, KeyError) as error:
        raise VLLMPolicyError(f"{adapter} is not a peft LoRA adapter folder: {error}") from error
