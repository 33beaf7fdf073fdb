"""What replies that solve nothing earn on an environment's validation tasks: the number a
"trained" figure must beat before anyone calls it learning.

For a single-turn environment (``score_response(example, text)``, e.g. the reasoning-gym
adapter), scores every validation task with a few constant replies: the empty reply, every
digit ("0123456789", the reply that earned 0.073 of a 0.100 "gain" under substring credit in
review 2026-12-07), a count "1 2 ... 18 0", and the most common answer of the split (the
best a reply that ignores the question can do on pass rate). Prints mean reward and pass
rate for each, one line a reply.

    .venv/bin/python scripts/degenerate_baselines.py configs/reasoning_gym.toml
"""

from __future__ import annotations

import argparse
import collections
import importlib
from pathlib import Path

from rollflow.config.run import load_config


def constant_replies(answers: list[str]) -> dict[str, str]:
    """Label -> reply; the most common answer comes last."""
    common, count = collections.Counter(answers).most_common(1)[0] if answers else ("", 0)
    return {
        "empty reply": "",
        "every digit '0123456789'": "0123456789",
        "a count '1 2 ... 18 0'": " ".join(str(n) for n in range(1, 19)) + " 0",
        f"the most common answer {common!r} ({count} of {len(answers)})": common,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--split", default="validation")
    args = parser.parse_args()
    config = load_config(args.config)
    module_name, function_name = config.env.name.split(":")
    environment = getattr(importlib.import_module(module_name), function_name)(**config.env.kwargs)
    examples = list(environment.examples(args.split))
    answers = [str(e.metadata.get("answer", e.output)) for e in examples]
    print(f"{config.env.name} {config.env.kwargs}: {len(examples)} {args.split} tasks")
    for label, reply in constant_replies(answers).items():
        results = [environment.score_response(e, reply) for e in examples]
        reward = sum(r.score for r in results) / len(results)
        passed = sum(r.score >= r.threshold for r in results) / len(results)
        print(f"  {label:48s} mean reward {reward:.3f}  pass rate {passed:.3f}")


if __name__ == "__main__":
    main()
