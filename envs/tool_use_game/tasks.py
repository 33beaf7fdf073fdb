"""The tool-use game's tasks: small hidden fact tables and questions that need them.

Each task has its own table of four to six facts such as ``crates_at_north_depot = 17``
(only the needed ones plus distractors) and a question that needs one to three of them
and one arithmetic step: "How many crates are at the north depot and the harbor
together?". The question names places and things in words; the keys are only learned
through ``list_fact_keys``, so a model has to use the tools to be sure.

Generation is deterministic from a seed (``random.Random(seed)``, nothing global). The
first ``num_train`` questions are the training split and the next ``num_validation`` the
validation split; question texts are unique across both, so no validation question is
trained on. Numbers are small integers and every answer is a non-negative integer, so
"the exact final number" is well defined.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from rollflow.envs.arithmetic import safe_eval
from rollflow.envs.checks import require_int
from rollflow.envs.types import TaskExample

ITEMS = ("crates", "barrels", "sacks", "trucks", "workers", "lamps", "boxes", "chairs", "goats", "ladders")
PLACES = (
    "north_depot", "river_mill", "harbor", "old_mine", "east_farm", "hill_school",
    "south_dock", "west_yard", "market", "bakery", "station", "library",
)  # fmt: skip


@dataclass(frozen=True)
class GameTask:
    """One question, the facts it may look up, and how the answer follows from them."""

    question: str
    facts: dict[str, int]  # the task's whole table, distractors included
    needed_keys: tuple[str, ...]  # in the order the formula uses them
    formula: str  # arithmetic over {0}, {1}, {2}: the needed values, in order
    answer: int

    def to_example(self, example_id: str) -> TaskExample:
        return TaskExample(
            input=self.question,
            output=self.answer,
            metadata={
                "facts": dict(self.facts),
                "needed_keys": list(self.needed_keys),
                "formula": self.formula,
                # rollflow's difficulty label (tasks/curriculum.py): the facts to look up, 1-3;
                # the step metrics report a pass rate per label
                "difficulty": len(self.needed_keys),
            },
            id=example_id,
        )


def fact_key(item: str, place: str) -> str:
    return f"{item}_at_{place}"


def generate_examples(
    seed: int, num_train: int, num_validation: int
) -> tuple[list[TaskExample], list[TaskExample]]:
    """``num_train`` training and ``num_validation`` validation examples, unique questions."""
    require_int("num_train", num_train, minimum=0)
    require_int("num_validation", num_validation, minimum=0)
    rng = random.Random(seed)
    tasks: list[GameTask] = []
    questions = {WORKED_EXAMPLE.question}  # never a task: the prompt already answers it
    attempts = 0
    while len(tasks) < num_train + num_validation:
        attempts += 1
        if attempts > 50 * (num_train + num_validation) + 100:
            raise ValueError(f"cannot generate {num_train + num_validation} distinct questions")
        task = _random_task(rng)
        if task.question not in questions:
            questions.add(task.question)
            tasks.append(task)
    examples = [task.to_example(f"tool_use_game/seed={seed}/{index:05d}") for index, task in enumerate(tasks)]
    return examples[:num_train], examples[num_train:]


def _random_task(rng: random.Random) -> GameTask:
    template = rng.choice(_TEMPLATES)
    item = rng.choice(ITEMS)
    places = rng.sample(PLACES, 3)
    values = [rng.randint(2, 60) for _ in places]
    question, needed_count, formula = template(rng, item, [_words(p) for p in places], values)
    needed = tuple(fact_key(item, place) for place in places[:needed_count])
    answer = _apply(formula, values[:needed_count])
    facts = dict(zip(needed, values[:needed_count], strict=True))
    _add_distractors(rng, facts, item, places[:needed_count])
    shuffled = list(facts.items())
    rng.shuffle(shuffled)
    return GameTask(
        question=question, facts=dict(shuffled), needed_keys=needed, formula=formula, answer=answer
    )


def _apply(formula: str, values: list[int]) -> int:
    """The answer, computed by the formula's own arithmetic (the formulas are ours, not model text)."""
    result = safe_eval(formula.format(*values))
    assert isinstance(result, int) and result >= 0, f"{formula} on {values} gave {result}"
    return result


def _add_distractors(rng: random.Random, facts: dict[str, int], item: str, used_places: list[str]) -> None:
    """Pad the table to 4-6 facts: the same item elsewhere, and other items at the same places."""
    target = rng.randint(max(4, len(facts) + 1), 6)
    while len(facts) < target:
        if rng.random() < 0.5:
            key = fact_key(item, rng.choice(PLACES))
        else:
            key = fact_key(rng.choice([i for i in ITEMS if i != item]), rng.choice(used_places))
        facts.setdefault(key, rng.randint(2, 60))


def _words(place: str) -> str:
    return "the " + place.replace("_", " ")


# A template gets (rng, item, place words, values) and returns (question, lookups needed,
# formula over the needed values). Values may be reordered to keep answers non-negative.
Template = Callable[[random.Random, str, list[str], list[int]], tuple[str, int, str]]


def _scaled(rng: random.Random, item: str, places: list[str], values: list[int]) -> tuple[str, int, str]:
    k = rng.randint(2, 9)
    return (
        f"If {places[0]} had {k} times as many {item} as it has now, how many {item} would it have?",
        1,
        f"{{0}} * {k}",
    )


def _received(rng: random.Random, item: str, places: list[str], values: list[int]) -> tuple[str, int, str]:
    k = rng.randint(3, 40)
    return (
        f"{places[0].capitalize()} receives {k} more {item}. How many {item} does it have then?",
        1,
        f"{{0}} + {k}",
    )


def _together(rng: random.Random, item: str, places: list[str], values: list[int]) -> tuple[str, int, str]:
    return f"How many {item} are at {places[0]} and {places[1]} together?", 2, "{0} + {1}"


def _more_than(rng: random.Random, item: str, places: list[str], values: list[int]) -> tuple[str, int, str]:
    if values[0] < values[1]:
        values[0], values[1] = values[1], values[0]
    return f"How many more {item} are at {places[0]} than at {places[1]}?", 2, "{0} - {1}"


def _plus_times(rng: random.Random, item: str, places: list[str], values: list[int]) -> tuple[str, int, str]:
    k = rng.randint(2, 5)
    question = (
        f"{places[0].capitalize()} keeps its own {item} and gets {k} times as many {item} "
        f"as {places[1]} has. How many {item} does {places[0]} have then?"
    )
    return question, 2, f"{{0}} + {k} * {{1}}"


def _in_total(rng: random.Random, item: str, places: list[str], values: list[int]) -> tuple[str, int, str]:
    return f"How many {item} are at {places[0]}, {places[1]} and {places[2]} in total?", 3, "{0} + {1} + {2}"


def _together_minus(
    rng: random.Random, item: str, places: list[str], values: list[int]
) -> tuple[str, int, str]:
    if values[2] > values[0] + values[1]:
        values[2] = values[0] + values[1]
    question = f"How many {item} are at {places[0]} and {places[1]} together, minus those at {places[2]}?"
    return question, 3, "{0} + {1} - {2}"


_TEMPLATES: tuple[Template, ...] = (
    _scaled,
    _received,
    _together,
    _more_than,
    _plus_times,
    _in_total,
    _together_minus,
)

# The worked example the prompt carries (fixed, outside every generated split).
WORKED_EXAMPLE = GameTask(
    question="How many lamps are at the harbor and the station together?",
    facts={"goats_at_harbor": 5, "lamps_at_harbor": 14, "chairs_at_market": 21, "lamps_at_station": 9},
    needed_keys=("lamps_at_harbor", "lamps_at_station"),
    formula="{0} + {1}",
    answer=23,
)
