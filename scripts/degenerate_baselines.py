"""What replies that solve nothing earn on an environment's validation tasks: the number a
"trained" figure must beat before anyone calls it learning.

Plays every validation task of the config's environment (any style, multi-turn too; each
member of a mixture apart) with a policy that gives the same reply every turn, and scores
the episodes as a run's scoring stage does (its pass rule: the environment's reward against
its threshold, never a parse failure or an error). The replies: the empty reply, every
digit ("0123456789", the reply that earned 0.073 of a 0.100 "gain" under substring credit
in review 2026-12-07), a count "1 2 ... 18 0", the most common answer of the split where the
tasks carry answers (the best a reply that ignores the question can do on pass rate), and
any ``--reply TEXT`` given (e.g. ``--reply "[10]"`` for GuessTheNumber). Prints mean reward
and pass rate for each, one line a reply (and environment).

    .venv/bin/python scripts/degenerate_baselines.py configs/reasoning_gym.toml
    .venv/bin/python scripts/degenerate_baselines.py configs/textarena.toml --reply "[10]"
"""

from __future__ import annotations

import argparse
import asyncio
import collections
from collections.abc import Sequence
from pathlib import Path

from rollflow.config.run import RunConfig, load_config
from rollflow.envs.handle import EnvironmentHandle, TaskItem
from rollflow.envs.runner import load_environment_handle, play_groups
from rollflow.envs.scripted import ScriptedPolicy
from rollflow.envs.types import Task, TaskExample
from rollflow.tasks.schedule import episode_limits, run_strata, select_validation_tasks
from rollflow.tasks.shaping import ending_of, env_passed


def answer_of(item: TaskItem) -> str | None:
    """The task's expected answer where it carries one (``metadata["answer"]``, the example's
    output, an async task's target); None otherwise."""
    payload = item.payload
    if isinstance(payload, TaskExample):
        answer = payload.metadata.get("answer", payload.output)
    elif isinstance(payload, Task):
        answer = payload.target
    else:
        answer = None
    return None if answer is None or isinstance(answer, dict | list) else str(answer)


def constant_replies(answers: Sequence[str], extra: Sequence[str] = ()) -> dict[str, str]:
    """Label -> reply; the most common answer (where the tasks have answers), then ``extra``."""
    replies = {
        "empty reply": "",
        "every digit '0123456789'": "0123456789",
        "a count '1 2 ... 18 0'": " ".join(str(n) for n in range(1, 19)) + " 0",
    }
    if answers:
        common, count = collections.Counter(answers).most_common(1)[0]
        replies[f"the most common answer {common!r} ({count} of {len(answers)})"] = common
    replies.update({f"always {reply!r}": reply for reply in extra})
    return replies


def score_constant(
    config: RunConfig, handle: EnvironmentHandle, items: Sequence[TaskItem], reply: str, split: str
) -> tuple[float, float]:
    """(mean reward, pass rate) of ``reply`` given every turn of every task's one episode."""
    policy = ScriptedPolicy(lambda messages, turn: reply)
    limits = episode_limits(config, split, handle.style)
    groups = asyncio.run(play_groups(handle, items, 1, policy, limits, config.rollout.concurrency))
    rewards, passes = [], []
    for item, (rollout,) in zip(items, groups, strict=True):
        (score,) = asyncio.run(handle.score(item, [rollout]))
        rewards.append(score.reward)
        passes.append(env_passed(ending_of(rollout, score), score))
    return sum(rewards) / len(rewards), sum(passes) / len(passes)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--split", default="validation", choices=("train", "validation"))
    parser.add_argument("--reply", action="append", default=[], help="a constant reply to score too (repeatable)")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    handle = load_environment_handle(config.env.name, config.env.kwargs)
    for stratum in run_strata(config, handle, args.split):
        items = select_validation_tasks(stratum.items, config.validation.num_tasks if args.split == "validation" else None)
        answers = [a for a in map(answer_of, items) if a is not None]
        print(f"{stratum.label}: {len(items)} {args.split} tasks")
        for label, reply in constant_replies(answers, args.reply).items():
            reward, passed = score_constant(config, handle, items, reply, args.split)
            print(f"  {label:48s} mean reward {reward:.3f}  pass rate {passed:.3f}")


if __name__ == "__main__":
    main()
