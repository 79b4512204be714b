"""Chat prompts the project generates itself, for training and measuring a drafter on an instruct model.

Two sources, each split so that evaluation never sees a training prompt:
- coding requests built from the Python standard library (model/corpus.py): "write a function that
  <its docstring's first line>" and "explain this code"; held-out modules give the eval split;
- general questions: a template applied to a topic; topics are split between train and eval.
"""

from __future__ import annotations

import ast
import random
import zlib

from .corpus import read_text, stdlib_files

TEMPLATES = (
    "What is {}?", "Explain {} in simple terms.", "Give me three facts about {}.", "Write a short poem about {}.",
    "Why is {} important?", "Write a short story about {}.", "How does {} work?", "Describe {} to a child.",
    "What are the advantages and disadvantages of {}?", "Write a haiku about {}.", "Summarize the history of {}.",
    "List five words related to {}.", "What would happen without {}?", "Write a tweet about {}.",
    "Compare {} with something similar.", "Give me a fun fact about {}.",
)
TOPICS = (
    "the sun", "the moon", "photosynthesis", "gravity", "volcanoes", "the ocean", "rainbows", "electricity",
    "the internet", "computers", "bicycles", "trains", "airplanes", "bread", "coffee", "tea", "chocolate",
    "dogs", "cats", "elephants", "bees", "trees", "rivers", "mountains", "deserts", "snow", "clouds",
    "music", "painting", "poetry", "chess", "football", "swimming", "running", "sleep", "dreams",
    "friendship", "happiness", "kindness", "time", "money", "banks", "cities", "villages", "farming",
    "recycling", "climate change", "solar power", "wind energy", "batteries", "robots", "artificial intelligence",
    "the human heart", "the brain", "vitamins", "exercise", "breakfast", "libraries", "books", "newspapers",
    "democracy", "the Roman Empire", "ancient Egypt", "the printing press", "the telephone", "vaccines",
    "penguins", "dolphins", "spiders", "butterflies", "the rain forest", "earthquakes", "the planets",
    "Mars", "stars", "black holes", "light", "sound", "magnets", "water", "salt", "sugar", "rice", "pizza",
    "birthdays", "holidays", "the weekend", "school", "teachers", "homework", "mathematics", "prime numbers",
    "fractions", "geometry", "maps", "compasses", "clocks", "calendars", "languages", "writing", "email",
    "passwords", "smartphones", "video games", "movies", "theaters", "museums", "gardens", "flowers",
    "honey", "cheese", "milk", "apples", "bananas", "oranges", "the color blue", "the number zero",
    "bridges", "roads", "cars", "electric cars", "rockets", "satellites", "telescopes", "microscopes",
    "bacteria", "viruses", "cells", "DNA", "evolution", "dinosaurs", "fossils", "glaciers", "islands",
)


def _eval_topic(topic: str) -> bool:
    return zlib.crc32(topic.encode()) % 5 == 0  # a fixed fifth of the topics, never trained on


def general_prompts(split: str) -> list[str]:
    return [t.format(topic) for topic in TOPICS if _eval_topic(topic) == (split == "eval") for t in TEMPLATES]


def code_prompts(split: str, max_lines: int = 16) -> list[str]:
    """Requests about the standard library's documented functions (held-out modules for 'eval')."""
    out = []
    for text in read_text(stdlib_files(split)):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            first = doc.strip().splitlines()[0].strip().rstrip(".")
            if len(first) < 12:
                continue
            args = ", ".join(a.arg for a in node.args.args if a.arg != "self")
            out.append(f"Write a Python function `{node.name}({args})`: {first[0].lower() + first[1:]}.")
            body = lines[node.lineno - 1: min(node.end_lineno or node.lineno, node.lineno - 1 + max_lines)]
            out.append("Explain what this Python code does:\n```python\n" + "\n".join(body) + "\n```")
    return out


def chat_prompts(split: str = "train", n: int | None = None, seed: int = 0) -> list[str]:
    """User messages, half general questions and half coding requests, shuffled; split 'train' or 'eval'."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rnd = random.Random(seed)
    general, code = general_prompts(split), code_prompts(split)
    rnd.shuffle(general)
    rnd.shuffle(code)
    mixed = [p for pair in zip(general, code, strict=False) for p in pair]
    mixed += general[len(mixed) // 2:] + code[len(mixed) // 2:]
    return mixed if n is None else mixed[:n]
