"""reasoning-gym datasets as rollflow single-turn environments (the ``reasoning-gym`` extra).

``[env].name = "rollflow.envs.reasoning_gym:load_environment"`` with ``[env.kwargs]`` such as
``dataset = "basic_arithmetic"``, ``size = 500``, ``seed = 0`` plays one of the library's
procedural datasets. Each entry (``question``, ``answer``, ``metadata``) becomes one
``TaskExample``; an episode is one prompt and one reply (``EnvironmentSingleTurn``), so
it runs through the same runner, scoring, Parquet records and SQL as the bundled tasks.

Judging is the library's: the reply's answer is read (``answer_format``) and handed to the
dataset's ``score_answer(answer, entry)``, whose 1.0 is the dataset's own equivalence (some
compare numbers, sets or expressions, not strings). Reading the answer:

- ``"tags"``: the text inside the last ``<answer>...</answer>``, as reasoning-gym's own
  training code reads it (no tags, no answer);
- ``"final"``: the tags when the reply has them; otherwise the reply's final answer: the last
  number in it when the oracle answer is a number, else its last line with a leading
  "Answer:" / "The answer is" and a closing full stop taken off (``final_answer``);
- ``"raw"``: the whole reply, stripped.

``credit`` decides what the dataset's score becomes. ``"exact"`` (the default): the reward is
1.0 when the dataset scores the answer 1.0 and 0.0 otherwise. ``"dataset"``: the library's
score as it is, partial credit included. Beware that partial credit: most datasets' default
``score_answer`` gives ``len(oracle) / len(answer)`` to any answer that merely *contains*
the oracle string, so with ``"raw"`` a constant reply of every digit earns about 0.07 on
one-digit arithmetic while solving nothing (review 2026-12-07, F2). An episode passes at
``pass_threshold`` (1.0) either way. Components: ``score`` (the reward), ``dataset_score``
(the library's own value), ``answered`` (an answer was found in the reply at all).

SFT targets come from the entry's answer, written the way the scorer reads it
(``<answer>42</answer>``, or the bare answer with ``"raw"``), so ``rollflow sft`` and the
scripted ``expert_policy()`` both give replies the library scores 1.0.

Splits never overlap: one dataset object is built from ``seed``; training takes indexes
``0..size-1``, validation the first ``num_validation`` entries after them whose question
is not also a training question (small datasets repeat themselves), looking at most
``VALIDATION_SCAN * num_validation`` entries further, so a tiny question space gives fewer
validation tasks rather than leaked ones. (A second seed would not do: reasoning-gym
seeds entry ``i`` from ``seed + i``, so seed 1's entry 0 *is* seed 0's entry 1.)

Errors before anything runs: the library not installed, an unknown dataset (with close
names and a few valid ones), arguments its config refuses, or an exception while
generating entries, each as one line naming ``[env].kwargs`` (the runner turns it into
the preflight's ``ConfigError``).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from rollflow.envs.checks import require_int
from rollflow.envs.scripted import ScriptedPolicy, latest_user_content
from rollflow.envs.single_turn import EnvironmentSingleTurn
from rollflow.envs.types import Message, RewardResult, TaskExample

EXTRA = "pip install 'rollflow[reasoning-gym]'"
ANSWER_FORMATS = ("tags", "final", "raw")
CREDITS = ("exact", "dataset")
# Our own prompt, in the spirit of the library's "default" system prompt: think, then put
# only the final answer inside the tags the scorer reads.
TAGS_PROMPT = (
    "Solve the problem. Think step by step if it helps, then give only the final answer "
    "inside <answer> and </answer>, in the format the question asks for."
)
# Validation looks at most this many entries per wanted task past the training range.
VALIDATION_SCAN = 4
RAW_PROMPT = "Solve the problem. Reply with only the final answer, in the format the question asks for."
# A number as replies write it: a sign, thousands separators, a decimal part.
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")
_ANSWER_LEAD = re.compile(r"^(?:the\s+)?(?:final\s+)?answer(?:\s+is)?\s*[:=]?\s*", re.IGNORECASE)


class ReasoningGymEnvironment(EnvironmentSingleTurn):
    """One reasoning-gym dataset: ``examples(split)`` are its entries, scored by its own
    ``score_answer``. Build it with ``load_environment``."""

    def __init__(
        self,
        dataset_name: str,
        library_dataset: Any,
        train: Sequence[TaskExample],
        validation: Sequence[TaskExample],
        entries: Mapping[str, dict[str, Any]],
        *,
        answer_format: str = "tags",
        credit: str = "exact",
        system_prompt: str | None = None,
        pass_threshold: float = 1.0,
    ) -> None:
        self.dataset_name = dataset_name
        self.library_dataset = library_dataset
        self.dataset = {"train": list(train), "validation": list(validation)}
        self._entries = dict(entries)
        self.answer_format = answer_format
        self.credit = credit
        self.system_prompt = system_prompt if system_prompt is not None else _default_prompt(answer_format)
        self.pass_threshold = pass_threshold

    def build_prompt_messages(self, example: TaskExample) -> list[Message]:
        messages: list[Message] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": str(example.input)})
        return messages

    def entry(self, example: TaskExample) -> dict[str, Any]:
        """The library's own entry behind ``example`` (what ``score_answer`` is given)."""
        found = self._entries.get(example.id or "")
        if found is not None:
            return found
        metadata = example.metadata
        return {"question": example.input, "answer": metadata.get("answer"), "metadata": metadata.get("entry_metadata", {})}

    def extract(self, response_text: str, oracle: object = None) -> str | None:
        """The answer in a reply, read the ``answer_format`` way (``oracle``, the entry's
        answer, tells ``"final"`` whether to look for a number)."""
        if self.answer_format == "raw":
            text = response_text.strip()
            return text or None
        from reasoning_gym.utils import extract_answer

        tagged = extract_answer(response_text)
        if self.answer_format == "tags" or tagged is not None:
            return tagged
        return final_answer(response_text, oracle)

    def score_response(self, example: TaskExample, response_text: str) -> RewardResult:
        entry = self.entry(example)
        answer = self.extract(response_text, entry.get("answer"))
        dataset_score = float(self.library_dataset.score_answer(answer, entry))
        score = dataset_score if self.credit == "dataset" else float(dataset_score >= 1.0)
        return RewardResult(
            score=score,
            threshold=self.pass_threshold,
            components={"score": score, "dataset_score": dataset_score, "answered": float(answer is not None)},
        )

    def format_answer(self, answer: str) -> str:
        """``answer`` written as a reply the scorer reads: the SFT target's form."""
        return f"<answer>{answer}</answer>" if self.answer_format == "tags" else answer


def final_answer(reply: str, oracle: object = None) -> str | None:
    """The final answer of an untagged reply: its last number when ``oracle`` is a number
    (``"7 + 2 = 9."`` -> ``"9"``; ``"1,200"`` -> ``"1200"``; ``"9.0"`` -> ``"9"`` when the
    oracle is an integer), else its last non-empty line without a leading "The answer is" /
    "Answer:" and a closing full stop. ``None`` when there is nothing to read."""
    if _is_number(oracle):
        numbers = _NUMBER.findall(reply)
        return _normalized_number(numbers[-1], str(oracle)) if numbers else None
    lines = [line.strip() for line in reply.strip().splitlines() if line.strip()]
    if not lines:
        return None
    text = _ANSWER_LEAD.sub("", lines[-1]).strip()
    text = text[:-1].rstrip() if text.endswith(".") else text
    return text or None


def _is_number(value: object) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int | float):
        return True
    return isinstance(value, str) and _NUMBER.fullmatch(value.strip()) is not None


def _normalized_number(text: str, oracle: str) -> str:
    """``text`` as the oracle writes numbers: no separators or plus sign, and an integral
    value without its ``.0`` when the oracle is an integer."""
    text = text.replace(",", "").lstrip("+")
    if "." in text and "." not in oracle.strip() and float(text).is_integer():
        return str(int(float(text)))
    return text


def _default_prompt(answer_format: str) -> str:
    return TAGS_PROMPT if answer_format == "tags" else RAW_PROMPT


def load_environment(
    dataset: str = "basic_arithmetic",
    size: int = 500,
    seed: int = 0,
    num_validation: int = 50,
    answer_format: str = "tags",
    credit: str = "exact",
    system_prompt: str | None = None,
    pass_threshold: float = 1.0,
    **dataset_kwargs: Any,
) -> ReasoningGymEnvironment:
    """reasoning-gym's ``dataset`` with ``size`` training and ``num_validation`` validation
    entries from ``seed``; any other keyword goes to the dataset's own config (e.g.
    ``min_terms``, ``max_digits`` for ``basic_arithmetic``). ``answer_format`` and ``credit``
    are the module docstring's; ``system_prompt`` replaces the default instruction ("" for
    none)."""
    require_int("[env].kwargs size", size, minimum=1)
    require_int("[env].kwargs num_validation", num_validation, minimum=0)
    require_int("[env].kwargs seed", seed, minimum=0)
    if answer_format not in ANSWER_FORMATS:
        raise ValueError(f"[env].kwargs answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
    if credit not in CREDITS:
        raise ValueError(f"[env].kwargs credit must be one of {CREDITS}, got {credit!r}")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise ValueError(f"[env].kwargs system_prompt must be text, got {type(system_prompt).__name__}")
    if isinstance(pass_threshold, bool) or not isinstance(pass_threshold, int | float):
        raise ValueError(f"[env].kwargs pass_threshold must be a number, got {pass_threshold!r}")
    window = size + VALIDATION_SCAN * num_validation
    library_dataset = create_library_dataset(dataset, window, seed, dataset_kwargs)
    entries: dict[str, dict[str, Any]] = {}
    train: list[TaskExample] = []
    validation: list[TaskExample] = []
    seen_in_train: set[str] = set()
    for index in range(window):
        if index >= size and len(validation) == num_validation:
            break
        entry = _entry_at(library_dataset, dataset, index)
        if index >= size and entry["question"] in seen_in_train:
            continue  # a repeat of a training question would leak into validation
        example = _example(dataset, seed, index, entry, answer_format)
        (train if index < size else validation).append(example)
        if index < size:
            seen_in_train.add(entry["question"])
        entries[str(example.id)] = entry
    return ReasoningGymEnvironment(
        dataset, library_dataset, train, validation, entries,
        answer_format=answer_format, credit=credit, system_prompt=system_prompt,
        pass_threshold=float(pass_threshold),
    )  # fmt: skip


def create_library_dataset(name: str, size: int, seed: int, kwargs: Mapping[str, Any]) -> Any:
    """``reasoning_gym.create_dataset(name, size=..., seed=..., **kwargs)``, its failures as
    one line naming ``[env].kwargs``."""
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError as exc:
        raise RuntimeError(
            f"[env].kwargs dataset = {name!r} needs the reasoning-gym library, which is not installed "
            f"({exc}): {EXTRA}"
        ) from None
    if not isinstance(name, str) or name not in DATASETS:
        raise ValueError(f"[env].kwargs dataset = {name!r} is not a reasoning-gym dataset; {_name_hint(name, DATASETS)}")
    config_class = DATASETS[name][1]
    fields = sorted(f.name for f in dataclasses.fields(config_class) if f.name not in ("seed", "size"))
    unknown = sorted(set(kwargs) - set(fields))
    if unknown:
        raise ValueError(
            f"[env].kwargs {', '.join(unknown)}: not a setting of reasoning-gym's {name!r} "
            f"(it takes {', '.join(fields) or 'none'}, besides size and seed)"
        )
    try:
        return reasoning_gym.create_dataset(name, size=size, seed=seed, **kwargs)
    except Exception as exc:  # the library's own check (often a bare assert) refused the config
        raise ValueError(
            f"[env].kwargs: reasoning-gym's {name!r} refused {dict(kwargs)!r}: "
            f"{type(exc).__name__}: {_one_line(exc)}"
        ) from None


def _entry_at(library_dataset: Any, name: str, index: int) -> dict[str, Any]:
    try:
        entry = library_dataset[index]
    except Exception as exc:
        raise ValueError(
            f"[env].kwargs: reasoning-gym's {name!r} failed to generate entry {index}: "
            f"{type(exc).__name__}: {_one_line(exc)}"
        ) from None
    if not isinstance(entry, Mapping) or not {"question", "answer"} <= set(entry):
        raise ValueError(f"reasoning-gym's {name!r} entry {index} has no question and answer: {entry!r:.200}")
    return dict(entry)


def _example(name: str, seed: int, index: int, entry: Mapping[str, Any], answer_format: str) -> TaskExample:
    answer = entry["answer"]
    target = None if answer is None else (f"<answer>{answer}</answer>" if answer_format == "tags" else str(answer))
    return TaskExample(
        input=str(entry["question"]),
        output=target,
        metadata={
            "library": "reasoning_gym",
            "dataset": name,
            "index": index,
            "answer": answer,
            "entry_metadata": entry.get("metadata", {}),
        },
        id=f"reasoning_gym/{name}/seed={seed}/{index:05d}",
    )


def _name_hint(name: object, known: Mapping[str, Any]) -> str:
    names = sorted(known)
    close = difflib.get_close_matches(str(name), names, n=3, cutoff=0.6)
    close_text = f"did you mean {', '.join(close)}? " if close else ""
    sample = ", ".join(n for n in ("basic_arithmetic", "chain_sum", "leg_counting", "gsm_symbolic") if n in known)
    return f"{close_text}it has {len(names)}, e.g. {sample or ', '.join(names[:4])}"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] or "(no message)"


def expert_policy(environment: ReasoningGymEnvironment) -> ScriptedPolicy:
    """Replies with each question's own answer, in the scorer's format (a baseline)."""
    answers = {
        str(example.input): environment.format_answer(str(example.metadata["answer"]))
        for split in ("train", "validation")
        for example in environment.examples(split)  # type: ignore[arg-type]
    }

    def script(messages: Sequence[Message], turn: int) -> str:
        return answers.get(latest_user_content(messages), "I don't know.")

    return ScriptedPolicy(script)


def dataset_names() -> list[str]:
    """Every dataset name reasoning-gym registers (the library must be installed)."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)
