"""Instruction data for the experiment: an embedded generated set, loading, prompts and masking.

The embedded set is generated here from templates and small word lists written for this project
(no third-party text), so it is licence-clean and needs no network. Its 17 task families (arithmetic,
string edits, lookups, lists of varying length) give the model something to learn in a few
hundred steps and a wide spread of response lengths for the length-grouped settings.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
IGNORE_INDEX = -100  # label of tokens that carry no loss (prompt and padding)
EMBEDDED = "embedded"

WORDS = (
    "apple river stone cloud garden window candle forest silver pepper rocket mirror basket island lemon "
    "tiger violin bridge pillow marble ocean butter camera dragon ladder meadow orange planet rabbit saddle "
    "thunder velvet wagon yellow zebra anchor breeze cactus desert engine feather glacier harbor jacket kettle "
    "lantern magnet needle oyster parrot quartz ribbon shadow tunnel umbrella valley walnut blossom canyon "
    "dolphin falcon giraffe horizon igloo jungle koala lizard mango nutmeg orchid pebble quiver raven "
    "spider tomato unicorn vacuum whistle copper pencil summer winter autumn spring coffee bottle castle"
).split()
ANTONYMS = {
    "hot": "cold", "big": "small", "fast": "slow", "happy": "sad", "light": "dark", "early": "late",
    "open": "closed", "full": "empty", "strong": "weak", "high": "low", "old": "young", "rich": "poor",
    "loud": "quiet", "wet": "dry", "hard": "soft", "first": "last", "up": "down", "inside": "outside",
    "near": "far", "thick": "thin", "heavy": "light", "sweet": "sour", "wide": "narrow", "clean": "dirty",
}
CAPITALS = {
    "France": "Paris", "Japan": "Tokyo", "Italy": "Rome", "Spain": "Madrid", "Germany": "Berlin",
    "Canada": "Ottawa", "Egypt": "Cairo", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
    "Poland": "Warsaw", "Greece": "Athens", "Chile": "Santiago", "India": "New Delhi", "China": "Beijing",
    "Brazil": "Brasilia", "Mexico": "Mexico City", "Sweden": "Stockholm", "Austria": "Vienna",
    "Portugal": "Lisbon", "Ireland": "Dublin", "Finland": "Helsinki", "Hungary": "Budapest",
    "Thailand": "Bangkok", "Vietnam": "Hanoi", "Argentina": "Buenos Aires", "Australia": "Canberra",
}
COLORS = "red blue green purple golden grey white black pink brown".split()
ANIMALS = "cat dog horse owl fox bear whale goat duck frog".split()
PLACES = "the hill the lake the old barn the market the library the beach the station the kitchen".split(" the ")
ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    rest = n % 100
    return ONES[n // 100] + " hundred" + ("" if rest == 0 else " and " + number_words(rest))


def _task(rng: random.Random) -> tuple[str, str, str]:
    """One (instruction, input, output) triple from a random task family."""
    kind = rng.randrange(17)
    word, other = rng.sample(WORDS, 2)
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    if kind == 0:
        return "Add the two numbers.", f"{a} and {b}", str(a + b)
    if kind == 1:
        return "Subtract the second number from the first.", f"{a + b} and {b}", str(a)
    if kind == 2:
        return "Multiply the two numbers.", f"{a % 13} and {b % 13}", str((a % 13) * (b % 13))
    if kind == 3:
        return "Reverse the letters of the word.", word, word[::-1]
    if kind == 4:
        return "Write the word in capital letters.", word, word.upper()
    if kind == 5:
        numbers = [rng.randint(0, 99) for _ in range(rng.randint(3, 9))]
        return "Sort these numbers from smallest to largest.", ", ".join(map(str, numbers)), ", ".join(map(str, sorted(numbers)))
    if kind == 6:
        country = rng.choice(sorted(CAPITALS))
        return f"What is the capital of {country}?", "", f"The capital of {country} is {CAPITALS[country]}."
    if kind == 7:
        adjective = rng.choice(sorted(ANTONYMS))
        return "Give the opposite of the word.", adjective, ANTONYMS[adjective]
    if kind == 8:
        return "Count the vowels in the word.", word, str(sum(c in "aeiou" for c in word))
    if kind == 9:
        celsius = rng.randrange(-20, 45, 5)
        return f"Convert {celsius} degrees Celsius to Fahrenheit.", "", f"{celsius} degrees Celsius is {celsius * 9 / 5 + 32:g} degrees Fahrenheit."
    if kind == 10:
        n = rng.randint(0, 999)
        return "Write the number in words.", str(n), number_words(n)
    if kind == 11:
        return "Is the number even or odd?", str(a), "even" if a % 2 == 0 else "odd"
    if kind == 12:
        count = rng.randint(2, 12)
        return f"List the first {count} multiples of {a % 12 + 2}.", "", ", ".join(str((a % 12 + 2) * i) for i in range(1, count + 1))
    if kind == 13:
        return "Spell the word letter by letter.", word, "-".join(word)
    if kind == 14:
        longer = "Yes" if len(word) > len(other) else "No"
        return f"Is the word '{word}' longer than the word '{other}'?", "", f"{longer}. '{word}' has {len(word)} letters and '{other}' has {len(other)}."
    if kind == 15:
        color, animal, place = rng.choice(COLORS), rng.choice(ANIMALS), rng.choice(PLACES).strip()
        return (
            "Write a short sentence about the animal, using the colour and the place.",
            f"animal: {animal}; colour: {color}; place: {place}",
            f"A {color} {animal} was resting near the {place.removeprefix('the ')}.",
        )
    start = rng.randint(1, 40)
    end = start + rng.randint(3, 25)
    return f"Count from {start} to {end}.", "", " ".join(str(i) for i in range(start, end + 1))


def embedded_rows(count: int = 4000, seed: int = 0) -> list[dict]:
    """``count`` generated instruction rows (instruction / input / output), deterministic in ``seed``."""
    rng = random.Random(seed)
    return [dict(zip(("instruction", "input", "output"), _task(rng))) for _ in range(count)]


def load_rows(spec: str, limit: int | None = None) -> list[dict]:
    """Alpaca-format rows from ``embedded``, a local JSON / JSON-lines file, or a hub dataset name.

    Hub datasets (e.g. ``tatsu-lab/alpaca``) go through ``datasets.load_dataset`` and need network
    access or a local cache; local files are read with the json module.
    """
    if spec == EMBEDDED:
        rows = embedded_rows()
    elif Path(spec).exists():
        text = Path(spec).read_text(encoding="utf-8")
        rows = json.loads(text) if text.lstrip().startswith("[") else [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        import datasets

        rows = list(datasets.load_dataset(spec, split="train"))
    missing = [key for key in ("instruction", "output") if rows and key not in rows[0]]
    if not rows or missing:
        raise ValueError(f"{spec}: expected Alpaca-format rows with instruction / input / output, got {len(rows)} rows missing {missing}")
    rows = [{"instruction": r["instruction"], "input": r.get("input") or "", "output": r["output"]} for r in rows]
    return rows[:limit] if limit else rows


def prompt(row: dict) -> str:
    template = PROMPT_WITH_INPUT if row["input"] else PROMPT_NO_INPUT
    return template.format(instruction=row["instruction"], input=row["input"])


def encode(tokenizer, row: dict, max_length: int) -> dict:
    """Token ids of prompt + response + EOS, with labels -100 on the prompt (loss on the response only)."""
    prompt_ids = tokenizer(prompt(row), add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(row["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    input_ids = (prompt_ids + response_ids)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + response_ids)[:max_length]
    return {"input_ids": input_ids, "labels": labels}


def collate(examples: list[dict], pad_id: int) -> dict:
    """Right-pad a batch; padding gets label -100 and attention mask 0."""
    import torch

    width = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        labels[i, :n] = torch.tensor(e["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}
