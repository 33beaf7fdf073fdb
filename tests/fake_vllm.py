"""Stand-ins for a managed vLLM server and its policy, for tests of the generator's
bookkeeping: they record what was started, loaded and reloaded, and sample nothing. The
``fake_vllm`` fixture (tests/conftest.py) puts them in place of the real ones."""

from __future__ import annotations

import threading
from pathlib import Path

from rollflow.policy.vllm_spec import VLLMServerSpec

DEAD_URL = "http://127.0.0.1:9/v1"  # the discard port: nothing listens, connections are refused


class FakeServer:
    """Stands in for ``VLLMServer``: records the specs it was started with."""

    specs: list[VLLMServerSpec] = []

    def __init__(self, spec: VLLMServerSpec, log_path: Path | None = None, startup_timeout_s: float = 0.0) -> None:
        self.spec, self.log_path = spec, log_path
        self.running = True
        self.base_url = DEAD_URL
        self.restarts, self.startup_s = 0, 0.0

    def start(self) -> FakeServer:
        return self.spawn().wait_ready()

    def spawn(self) -> FakeServer:
        FakeServer.specs.append(self.spec)
        return self

    def wait_ready(self) -> FakeServer:
        return self

    def restart(self, reason: str, *, log_path: Path | None = None) -> FakeServer:
        self.running, self.restarts = True, self.restarts + 1
        return self

    def describe_exit(self) -> str:
        return "was stopped by the test" if not self.running else "is running"

    def log_tail(self) -> str:
        return "(a stand-in: no log)"

    def stop(self) -> None:
        self.running = False


class FakePolicy:
    """Stands in for ``VLLMPolicy``: records adapter loads and weight reloads."""

    def __init__(self) -> None:
        self.version = 0
        self.settings = None
        self.stats = None
        self.adapter_name: str | None = None
        self._loaded: dict[str, Path] = {}  # what VLLMGenerator.restart carries over (held_adapters)
        self.base_urls = (DEAD_URL,)
        self.calls: list[tuple[object, ...]] = []
        self.reload_started = threading.Event()
        self.reload_may_finish = threading.Event()
        self.reload_may_finish.set()

    def add_adapter(self, adapter_dir: Path, name: str, *, only: object = None) -> None:
        self.calls.append(("add", name, Path(adapter_dir)))

    def held_adapters(self) -> dict[str, Path]:
        return dict(self._loaded)

    def adopt_adapters(self, held: dict[str, Path], acting: str | None, *, only: object) -> None:
        self._loaded, self.adapter_name = dict(held), acting
        for name, folder in held.items():
            self.add_adapter(folder, name, only=only)

    def remove_adapter(self, name: str) -> None:
        self.calls.append(("remove", name))

    def reload_weights(self, model_dir: Path, version: int, *, only: object = None) -> float:
        self.calls.append(("reload", Path(model_dir), version))
        self.reload_started.set()
        self.reload_may_finish.wait()
        self.version = version
        return 0.0

    def pinned(self, version: int, *, adapter: str | None, seed: int) -> FakePolicy:
        return self
