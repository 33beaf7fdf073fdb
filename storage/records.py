"""The records stages hand each other, one Parquet table each.

Columns are the contract between stages: bump ``SCHEMA_VERSION`` whenever a column
changes meaning or type, and readers refuse files of another version with a clear error.
The Arrow schemas that match these dataclasses live in ``storage/arrow_schemas.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rollflow.envs.episode import EpisodeRollout

# 2: episodes gained ``context_tokens`` and ``prompt_tokens`` counts the final context once;
#    scores' ``passed`` is the environment's verdict, not the shaped reward's
SCHEMA_VERSION = 2


@dataclass(frozen=True)
class EpisodeRecord:
    """One played episode and where it sits in the run (``episodes.parquet``)."""

    run_id: str
    step: int
    split: str  # "train" | "validation"
    task_id: str
    group_id: str  # f"{split}/{step}/{task_index}": episodes of one task in one step
    episode_id: str  # deterministic: f"{group_id}/{index_in_group}"
    index_in_group: int
    rollout: EpisodeRollout
    # Where it was played: the Ray node's name ("head", "worker-1", ...; a node rollflow did
    # not start: its Ray node id) when the rollout ran on a cluster; None without one.
    # Added after SCHEMA_VERSION 2 without a bump: files without the column read it as None.
    node: str | None = None
    # The environment it was played in: its label (a mixture member's, envs/mixture_handle.py;
    # the one environment's short name otherwise). None in files written before it.
    env: str | None = None


@dataclass(frozen=True)
class ScoreRecord:
    """The reward of one episode and its group-relative advantage (``scores.parquet``)."""

    run_id: str
    step: int
    split: str
    task_id: str
    group_id: str
    episode_id: str
    reward: float  # what the environment's scorer (or terminal step) gave; 0.0 unscored
    threshold: float | None
    components: Mapping[str, float]
    overlong_penalty: float  # <= 0; only context_overflow and max_turns truncations
    final_reward: float  # reward + overlong_penalty, or failed_parse_reward on parse failure
    passed: bool  # reward >= threshold (None: reward > 0); never a parse failure or an error
    group_mean: float
    group_std: float
    group_size: int  # episodes that counted towards the baseline
    zero_variance: bool  # every counted episode of the group has the same final_reward
    advantage: float
    trained: bool  # False: errored, overlong-masked, or a skipped zero-variance group
    scoring_error: str | None = None
    env: str | None = None  # the episode's environment label (EpisodeRecord.env)


@dataclass(frozen=True)
class SampleRecord:
    """One training sequence cut from an episode (``samples.parquet``)."""

    run_id: str
    step: int
    sample_id: str  # f"{episode_id}#{index}"
    episode_id: str
    group_id: str
    input_ids: tuple[int, ...]  # (T,)
    loss_mask: tuple[int, ...]  # (T,) 0 = context, never trained; 1 = sampled action token
    advantages: tuple[float, ...]  # (T,) the episode's advantage on action tokens, 0 elsewhere
    sampler_logprobs: tuple[float, ...]  # (T,) logprob at sampling time on action tokens, 0 elsewhere
    env: str | None = None  # the episode's environment label (EpisodeRecord.env)

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        assert len(self.loss_mask) == n and len(self.advantages) == n, (
            f"sample {self.sample_id}: input_ids, loss_mask and advantages must align "
            f"({n}, {len(self.loss_mask)}, {len(self.advantages)})"
        )
        assert len(self.sampler_logprobs) == n, (
            f"sample {self.sample_id}: {n} tokens but {len(self.sampler_logprobs)} logprobs"
        )


@dataclass(frozen=True)
class TeacherRecord:
    """A teacher's logprobs of one sample's sampled tokens (``teacher.parquet``, OPD only).

    ``teacher_logprobs[t]`` is the teacher's ``log p(input_ids[t] | input_ids[:t])``,
    aligned to the sample's ``input_ids`` like ``sampler_logprobs``; 0 on context tokens.
    """

    run_id: str
    step: int
    sample_id: str
    episode_id: str
    teacher_logprobs: tuple[float, ...]  # (T,) 0 on context
    teacher_kl: float  # mean over action tokens of sampler_logprob - teacher_logprob
    num_action_tokens: int  # the tokens teacher_kl averages over (a step's mean weighs by it)


@dataclass(frozen=True)
class TrainResult:
    """What one GRPO update did (``train.json``)."""

    run_id: str
    step: int
    policy_version: int  # the version this update produced
    loss: float
    kl: float | None
    clip_fraction: float
    grad_norm: float
    num_samples: int
    num_tokens: int
    num_action_tokens: int
    learning_rate: float
    tokens_per_s: float
    timings: Mapping[str, float] = field(default_factory=dict)  # seconds, by phase
    # Off-policy figures (None in a train.json written before they existed, or where they
    # do not apply): mean k3 KL(sampler || trainer at step start) per action token, the mean
    # behaviour weight, the share of tokens truncated or masked (policy/loss.py).
    mismatch_kl: float | None = None
    is_weight_mean: float | None = None
    corrected_fraction: float | None = None
    # The Ray node that trained ("worker-1", ...; ``[cluster].trainer_node``); None where the
    # run's own process trained, and in a train.json written before it existed.
    node: str | None = None
