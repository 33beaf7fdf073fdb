"""The MLflow Model Registry for trained policies: versions, the ``champion`` alias, rollback.

A registered version points at a policy folder (an exported LoRA adapter or full weights,
with its tokenizer and chat template) and carries tags that say where it came from: the
pipeline run folder, the GRPO run folder, whether it is an adapter, and the base model it
goes on. Its gate metrics are tags too, so the registry UI shows why it was (or was not)
promoted. The ``champion`` alias is moved only by ``promote``; ``rollback`` is a promote
of an older version, by hand.

Registration is idempotent per pipeline run: a version already registered for a run
folder (found by its ``rollflow.pipeline_run`` tag) is returned, not registered again, so
a retried pipeline that crashed after registering never makes a second version.

This and ``storage/tracking.py`` are the only modules that import MLflow.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from rollflow.storage.tracking import default_tracking_uri

CHAMPION = "champion"
PIPELINE_RUN_TAG = "rollflow.pipeline_run"


class RegistryError(RuntimeError):
    """The registry refused an operation; the message names the model and version."""


@dataclass(frozen=True)
class PolicyVersion:
    name: str
    version: int
    source: Path  # the policy folder
    tags: Mapping[str, str]

    @property
    def is_adapter(self) -> bool:
        return self.tags.get("rollflow.adapter") == "true"

    @property
    def base_model(self) -> str | None:
        return self.tags.get("rollflow.base_model") or None


class PolicyRegistry:
    """One registered model in the MLflow registry at ``tracking_uri``."""

    def __init__(self, name: str, tracking_uri: str | None = None) -> None:
        self.name = name
        self.tracking_uri = tracking_uri or default_tracking_uri()
        if self.tracking_uri.startswith("sqlite:///"):
            Path(self.tracking_uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self._client = MlflowClient(tracking_uri=self.tracking_uri, registry_uri=self.tracking_uri)

    def register(
        self, source: Path, pipeline_run: Path, tags: Mapping[str, str], mlflow_run_id: str | None = None
    ) -> PolicyVersion:
        """A new version for ``source``, or the one already registered for ``pipeline_run``."""
        run_key = str(Path(pipeline_run).resolve())
        existing = [v for v in self.versions() if v.tags.get(PIPELINE_RUN_TAG) == run_key]
        if existing:
            return existing[-1]
        self._ensure_model()
        all_tags = {**{k: str(v) for k, v in tags.items()}, PIPELINE_RUN_TAG: run_key}
        try:
            made = self._client.create_model_version(
                self.name, source=str(Path(source).resolve()), run_id=mlflow_run_id, tags=all_tags
            )
        except MlflowException as exc:
            raise RegistryError(f"registering {source} as a version of {self.name!r} failed: {exc}") from exc
        return self.version(int(made.version))

    def versions(self) -> list[PolicyVersion]:
        """Every version, oldest first (none when the model is not registered yet)."""
        try:
            found = self._client.search_model_versions(f"name = '{self.name}'")
        except MlflowException:
            return []
        return sorted((self._policy_version(v) for v in found), key=lambda v: v.version)

    def model_names(self) -> list[str]:
        """Every registered model's name in this store (what a mistyped name may have meant)."""
        try:
            return sorted(m.name for m in self._client.search_registered_models())
        except MlflowException:
            return []

    def version(self, number: int) -> PolicyVersion:
        try:
            return self._policy_version(self._client.get_model_version(self.name, str(number)))
        except MlflowException as exc:
            raise RegistryError(f"{self.name!r} has no version {number}: {exc}") from exc

    def champion(self) -> PolicyVersion | None:
        try:
            found = self._client.get_model_version_by_alias(self.name, CHAMPION)
        except MlflowException:
            return None  # no such model yet, or no champion
        return self._policy_version(found)

    def promote(self, number: int) -> PolicyVersion:
        """Point ``champion`` at version ``number`` (also the way to roll back)."""
        version = self.version(number)
        self._client.set_registered_model_alias(self.name, CHAMPION, str(number))
        return version

    rollback = promote

    def tag(self, number: int, tags: Mapping[str, object]) -> None:
        for key, value in tags.items():
            self._client.set_model_version_tag(self.name, str(number), key, str(value))

    def _ensure_model(self) -> None:
        try:
            self._client.get_registered_model(self.name)
        except MlflowException:
            self._client.create_registered_model(
                self.name, description="Policies trained by rollflow; the champion alias marks the one in use."
            )

    def _policy_version(self, found: object) -> PolicyVersion:
        return PolicyVersion(
            name=self.name,
            version=int(getattr(found, "version")),
            source=Path(str(getattr(found, "source"))),
            tags=dict(getattr(found, "tags") or {}),
        )
