"""A small real verifiers environment for tests/test_envs_verifiers.py, built only from the
library's own classes over an in-memory ``datasets.Dataset`` (nothing is downloaded).

``load_environment(kind=...)``, as a verifiers environment package defines it:
- ``"single"``: a ``SingleTurnEnv`` of sums; the answer inside ``<answer>`` tags, read by
  an ``XMLParser``; reward ``correct_answer`` + 0.2 x the parser's format reward.
- ``"retry"``: a ``MultiTurnEnv`` subclass whose ``env_response`` says "higher"/"lower"
  after a wrong answer; it counts attempts in its state (``setup_state``) and stops by its
  own ``@vf.stop`` once the answer is right. Reward: 1 / attempts when right, else 0.
- ``"tool"``: a ``ToolEnv`` with an ``add`` tool; reward ``correct_answer``.
- ``"broken"``: ``env_response`` raises (an environment error during an episode).
- ``"groups"``: a rubric with a group reward function (refused by the adapter).
``with_eval`` gives an ``eval_dataset`` whose first question is also a training question.
``fail`` makes loading raise, as a library-side error would.
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

SUMS = [(a, b) for a in (2, 3, 5, 7) for b in (4, 6, 9)]  # 12 questions
SYSTEM = "Add the numbers. Put only the result inside <answer> and </answer>."


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def sums_dataset(pairs: list[tuple[int, int]]) -> Dataset:
    return Dataset.from_list([{"question": question(a, b), "answer": str(a + b)} for a, b in pairs])


def correct_answer(parser: vf.Parser, completion: vf.Messages, answer: str) -> float:
    return 1.0 if parser.parse_answer(completion) == answer else 0.0


class RetryEnv(vf.MultiTurnEnv):
    async def setup_state(self, state: vf.State) -> vf.State:
        state["attempts"] = 0
        return state

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: object) -> vf.Messages:
        state["attempts"] += 1
        guess = self.parser.parse_answer(messages)
        hint = "higher" if guess is None or not guess.isdigit() or int(guess) < int(state["answer"]) else "lower"
        return [vf.UserMessage(content=f"Not quite: try {hint}.")]

    @vf.stop
    async def answered_right(self, state: vf.State) -> bool:
        if not state["trajectory"]:
            return False
        right = self.parser.parse_answer(state["trajectory"][-1]["completion"]) == state["answer"]
        if right:
            state["attempts"] += 1
        return right


class BrokenEnv(vf.MultiTurnEnv):
    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: object) -> vf.Messages:
        raise KeyError("the game's table is missing")


def attempts_reward(state: vf.State, parser: vf.Parser, completion: vf.Messages, answer: str) -> float:
    return 1.0 / state["attempts"] if parser.parse_answer(completion) == answer else 0.0


def relative_reward(completions: list[vf.Messages]) -> list[float]:
    return [0.0 for _ in completions]


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def load_environment(kind: str = "single", num_rows: int = 12, with_eval: bool = False, fail: bool = False) -> vf.Environment:
    if fail:
        raise FileNotFoundError("questions.jsonl")
    dataset = sums_dataset(SUMS[:num_rows])
    eval_dataset = sums_dataset([SUMS[0], (11, 12), (13, 14)]) if with_eval else None
    parser = vf.XMLParser(["answer"], answer_field="answer")
    common = {"dataset": dataset, "eval_dataset": eval_dataset, "system_prompt": SYSTEM, "parser": parser}
    if kind == "single":
        rubric = vf.Rubric(funcs=[correct_answer, parser.get_format_reward_func()], weights=[1.0, 0.2], parser=parser)
        return vf.SingleTurnEnv(rubric=rubric, **common)
    if kind == "retry":
        return RetryEnv(rubric=vf.Rubric(funcs=[attempts_reward], parser=parser), max_turns=4, **common)
    if kind == "tool":
        return vf.ToolEnv(tools=[add], rubric=vf.Rubric(funcs=[correct_answer], parser=parser), max_turns=3, **common)
    if kind == "broken":
        return BrokenEnv(rubric=vf.Rubric(funcs=[correct_answer], parser=parser), max_turns=3, **common)
    if kind == "groups":
        rubric = vf.Rubric(funcs=[correct_answer, relative_reward], parser=parser)
        return vf.SingleTurnEnv(rubric=rubric, **common)
    raise ValueError(f"unknown kind {kind!r}")
