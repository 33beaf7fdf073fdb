"""The rules across config sections that a training run needs.

Each section checks its own fields (``rollflow.config.run``); what is left are the
combinations a training run cannot use and evaluation can: ``check_run_config`` applies
them all. ``flows.runs.open_run`` calls it on every run it opens, new or resumed, and
``ops.preflight.preflight`` first of all, before Prefect starts. ``PreflightError`` is what
preflight's own checks (the model files, the environment, the prompts) raise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollflow.config.parsing import ConfigError

if TYPE_CHECKING:
    from rollflow.config.run import RunConfig


class PreflightError(ConfigError):
    """A run would fail once started; the message names the setting and the value."""


def check_run_config(config: RunConfig) -> None:
    """Every rule below; the first broken one raises ``ConfigError``."""
    check_training_sampling(config)
    check_training_backend(config)
    check_async(config)
    check_cluster(config)
    check_task_schedule(config)
    check_mixture(config)


def check_mixture(config: RunConfig) -> None:
    """A mixture member's ``max_completion_tokens`` lowers the run's; above it, it would do
    nothing (the run's budget sizes every request), so it is refused rather than ignored."""
    run_budget = config.rollout.max_completion_tokens
    for number, member in enumerate(config.env.members, start=1):
        cap = member.max_completion_tokens
        if cap is not None and cap > run_budget:
            raise ConfigError(
                f"[[env.mixture]] #{number} ({member.label!r}): max_completion_tokens = {cap} is above "
                f"[rollout].max_completion_tokens = {run_budget}; a member may only lower it"
            )


def check_training_sampling(config: RunConfig) -> None:
    """Refuse sampling settings a training run cannot learn from (evaluation may use them).

    The trainer scores each sampled token under ``log_softmax(logits / temperature)``,
    the whole distribution. With ``top_p < 1`` the sampler drew from the renormalised
    nucleus instead, so the importance ratio would start at the nucleus mass (below 1),
    not 1, and the clip would act on that bias rather than on the policy's drift.
    """
    top_p = config.rollout.top_p
    if top_p < 1.0:
        raise ConfigError(
            f"[rollout].top_p = {top_p}: training needs 1.0. The trainer scores tokens under "
            "the whole distribution, so with a nucleus the importance ratio would start at the "
            "nucleus mass instead of 1; top_p < 1 is for `rollflow eval`"
        )


def check_training_backend(config: RunConfig) -> None:
    """Refuse a backend that cannot train: ``"openai"`` would never see new weights."""
    if config.rollout.backend == "openai":
        raise ConfigError(
            "[rollout].backend = 'openai' cannot train: no new weights ever reach the server, "
            "so every step would sample the starting policy (off-policy, every episode stamped "
            "version 0). Use backend = 'vllm' (a managed server, or your own with base_urls); "
            "'openai' is for `rollflow eval`"
        )


def check_async(config: RunConfig) -> None:
    """The async settings' rules (the reference's)."""
    rollout = config.rollout
    if rollout.max_steps_off_policy is None:
        if rollout.weight_sync_type != "synchronous":
            raise ConfigError(
                f"[rollout].weight_sync_type = {rollout.weight_sync_type!r} defers publication, "
                "which needs async collection to bound the drift it allows: set "
                "[rollout].max_steps_off_policy (1 is a good start) or use 'synchronous'"
            )
        return
    if rollout.weight_sync_type == "pipeline" and config.train.use_lora and (
        rollout.lora_serving == "adapter" or rollout.base_urls
    ):
        raise ConfigError(
            "[rollout].weight_sync_type = 'pipeline' needs weights swapped in place: full-weight "
            "training ([train].use_lora = false), or LoRA merged on a managed server "
            "([rollout].lora_serving = 'merged', no base_urls); in-flight generation switches to "
            "the new weights, which LoRA adapters keep per version instead ('background_publish')"
        )
    # Any keep_checkpoints works: pruning spares what the run still reads (a publication in
    # flight, adapters in use, the resume's checkpoint): generators/checkpoints.py's checkpoints_to_keep.
    if rollout.backend != "vllm":
        raise ConfigError(
            "[rollout].max_steps_off_policy (async collection) needs [rollout].backend = 'vllm': "
            "the rollout workers sample beside the trainer on a vLLM generator (the "
            f"'{rollout.backend}' backend would share the trainer's process)"
        )
    if rollout.base_urls and not config.train.use_lora:
        raise ConfigError(
            "[rollout].max_steps_off_policy with base_urls needs [train].use_lora = true: new "
            "full weights reach only a managed server (leave base_urls empty)"
        )


def check_cluster(config: RunConfig) -> None:
    """What runs on a Ray cluster today: lockstep rollouts on a vLLM generator
    (``cluster/ray_rollout.py``), its managed replicas and the train stage where ``[cluster]``
    places them (``cluster/ray_replicas.py``, ``cluster/ray_trainer.py``). Anything else is
    refused rather than run on one machine while ``[cluster]`` says otherwise."""
    mode = config.cluster.mode
    if mode == "none":
        return
    supported = (
        "on a cluster rollflow runs rollouts on a vLLM generator (lockstep: each chunk a Ray task "
        "sampling the generator's servers over HTTP), its replicas and the train stage where "
        "[cluster] places them (docs/cluster.md)"
    )
    if config.rollout.backend != "vllm":
        raise ConfigError(
            f"[cluster].mode = {mode!r} with [rollout].backend = {config.rollout.backend!r} is not "
            f"supported: {supported}. Use backend = 'vllm', or [cluster].mode = 'none' (the "
            f"'{config.rollout.backend}' backend samples in the trainer's process)"
        )
    cluster, rollout = config.cluster, config.rollout
    if rollout.max_steps_off_policy is not None and not (cluster.trains_on_cluster or cluster.serves_generators):
        raise ConfigError(
            f"[cluster].mode = {mode!r} with async collection ([rollout].max_steps_off_policy) places "
            "nothing on the cluster: an async run's episodes are played by its collector, so what the "
            "cluster can take is the trainer ([cluster].trainer_node / trainer_gpus) and the vLLM "
            "replicas ([cluster].generator_nodes / generator_gpus). Place one of them, or use "
            "[cluster].mode = 'none' for async on one machine"
        )
    if cluster.serves_generators and rollout.base_urls:
        raise ConfigError(
            "[cluster].generator_nodes / generator_gpus place managed vLLM replicas, and [rollout].base_urls "
            "names servers of your own: drop one of them"
        )
    if len(cluster.generator_nodes) > rollout.num_generator_replicas:
        raise ConfigError(
            f"[cluster].generator_nodes names {len(cluster.generator_nodes)} nodes for "
            f"{rollout.num_generator_replicas} replica(s) ([rollout].num_generator_replicas): a named node "
            "would get none; raise num_generator_replicas or name fewer nodes"
        )


def check_task_schedule(config: RunConfig) -> None:
    """Backfill and the curriculum are choices of the lockstep rollout stage (``tasks/rollout.py``).

    Backfill keeps only what dynamic sampling trains (groups with reward variance), so it
    needs it on. The async collector plays one task per group in the run's fixed order and
    its admission takes finished groups as they come, variance or not: neither option
    reaches it. On a Ray cluster each node recomputes its chunk from the step's plan, which
    a backfill round extends only after the round before it is scored: refused there.
    """
    rollout = config.rollout
    if rollout.backfill_rounds > 0 and not config.train.dynamic_sampling:
        raise ConfigError(
            f"[rollout].backfill_rounds = {rollout.backfill_rounds} refills the batch with groups that "
            "have reward variance, which only dynamic sampling trains apart: set "
            "[train].dynamic_sampling = true, or backfill_rounds = 0"
        )
    options = [name for name, on in (("backfill_rounds", rollout.backfill_rounds > 0),
                                     ("curriculum", rollout.curriculum)) if on]
    if options and rollout.max_steps_off_policy is not None:
        raise ConfigError(
            f"[rollout].{' and '.join(options)} choose the tasks of a lockstep step; async collection "
            "([rollout].max_steps_off_policy) plays the tasks in the run's fixed order and admits "
            "finished groups as they come. Drop max_steps_off_policy, or the option"
        )
    if rollout.backfill_rounds > 0 and config.cluster.mode != "none":
        raise ConfigError(
            f"[rollout].backfill_rounds with [cluster].mode = {config.cluster.mode!r} is not supported: "
            "a cluster's nodes play the chunks of the step's first round only. Set backfill_rounds = 0 "
            "on a cluster, or [cluster].mode = 'none'"
        )
