"""The training slot's limit is made once, also when two runs make it at the same moment."""

from __future__ import annotations

import uuid

import pytest


def test_a_limit_another_run_made_between_the_read_and_the_create_is_kept(
    prefect_harness: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two pipelines (or test workers) starting together on a fresh server both read "no
    limit" and both create it; the second create was a 409 and failed its run."""
    from prefect.client.orchestration import SyncPrefectClient, get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectNotFound

    from rollflow.flows import concurrency

    name = f"rollflow-training-{uuid.uuid4().hex[:8]}"  # the session's own limit stays untouched
    monkeypatch.setattr(concurrency, "TRAINING_LIMIT", name)

    def read_before_the_other_run_created_it(self: SyncPrefectClient, limit_name: str) -> object:
        assert limit_name == name
        self.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=7))  # the other run
        raise ObjectNotFound(http_exc=Exception(f"{name} not found"))

    with monkeypatch.context() as patched:
        patched.setattr(SyncPrefectClient, "read_global_concurrency_limit_by_name", read_before_the_other_run_created_it)
        concurrency.ensure_training_limit(1)
    try:
        with get_client(sync_client=True) as client:
            assert client.read_global_concurrency_limit_by_name(name).limit == 7  # the other run's
    finally:
        with get_client(sync_client=True) as client:
            client.delete_global_concurrency_limit_by_name(name)
