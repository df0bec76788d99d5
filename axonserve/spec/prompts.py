"""Built-in prompts for self-distilling a draft head: the target answers them, the head learns the answers.

Varied on purpose (chat instructions through the chat template, code, arithmetic, plain-text
continuations) so the head sees the kinds of text a served model writes. Held-out prompts use
topics, tasks and openings that never appear in training, so acceptance is not measured on
memorised contexts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TOPICS = [
    "photosynthesis", "black holes", "the French Revolution", "machine learning", "volcanoes", "the immune system",
    "climate change", "the stock market", "quantum computing", "the Roman Empire", "electric cars", "honeybees",
    "the internet", "jazz music", "the water cycle", "vaccines", "chess", "the Moon landing", "renewable energy",
    "sleep", "coffee", "the printing press", "earthquakes", "democracy", "DNA", "the Great Wall of China",
    "solar panels", "rainforests", "the human brain", "inflation", "blockchain", "the Olympic Games", "antibiotics",
    "glaciers", "the Renaissance", "smartphones", "plate tectonics", "meditation", "the Silk Road", "batteries",
    "whales", "the theory of relativity", "gardening", "bread baking", "the Amazon river", "robots", "tea",
    "the Industrial Revolution", "hurricanes", "photography", "the solar system", "bicycles", "dinosaurs",
    "public libraries", "nutrition", "the ocean tides", "airplanes", "recycling", "the piano", "mountains",
]
HELD_OUT_TOPICS = [
    "nuclear fusion", "coral reefs", "the Byzantine Empire", "origami", "penguins", "submarines",
    "the history of money", "wind turbines", "chocolate", "lighthouses", "the human heart", "ancient Egypt",
]
CHAT_TEMPLATES = [
    "Explain {t} to a ten-year-old.", "Write a short poem about {t}.", "What are the pros and cons of {t}?",
    "Give me five interesting facts about {t}.", "Summarize the history of {t} in a paragraph.",
    "Write a tweet about {t}.", "How does {t} affect everyday life?", "Write a short story involving {t}.",
    "What are common misconceptions about {t}?", "Describe {t} in three sentences.",
    "Write a haiku about {t}.", "List three questions a student might ask about {t}, and answer them.",
]
HELD_OUT_CHAT_TEMPLATES = ["Teach me the basics of {t}.", "Why should anyone care about {t}?"]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n", "merges two sorted lists",
    "counts the vowels in a string", "returns the n-th Fibonacci number", "removes duplicates from a list",
    "finds the largest element in a list", "checks whether a string is a palindrome", "flattens a nested list",
    "converts Celsius to Fahrenheit", "sorts a list of dictionaries by a key", "computes the mean of a list",
    "reads a text file and counts its words", "implements binary search", "transposes a matrix",
]
HELD_OUT_CODE_TASKS = ["computes the greatest common divisor of two numbers", "checks whether brackets are balanced"]
CONTINUATIONS = [
    "Once upon a time, in a small village by the sea,", "The recipe is simple. First,",
    "def fibonacci(n):\n", "import numpy as np\n\n", "The main reason people enjoy travelling is",
    "Q: What is the capital of France?\nA:", "In 1969, the world watched as", "Dear hiring manager,\n\n",
    "The three laws of thermodynamics are", "class Stack:\n    def __init__(self):\n",
    "Step 1: Preheat the oven to 180 degrees.\nStep 2:", "It was a dark and stormy night;",
    "The history of mathematics begins with", "Here is a list of tips for staying productive:\n1.",
    "Breaking news: scientists have discovered", "SELECT name, age FROM users WHERE",
]
HELD_OUT_CONTINUATIONS = ["The lighthouse keeper climbed the stairs and", "def quicksort(items):\n"]


@dataclass
class Prompt:
    """A chat message (rendered with the model's chat template) or a raw text continuation."""

    text: str
    chat: bool
    kind: str


def _arithmetic(rng: random.Random, n: int) -> list[Prompt]:
    out = []
    for _ in range(n):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        form = rng.choice([
            f"What is {a} + {b} * {c}? Show your steps.",
            f"A shop sells pencils for {c} dollars each. How much do {a} pencils cost?",
            f"Tom has {a} apples and gives away {min(a, b)}. How many are left? Explain.",
            f"Compute {a} * {b} step by step.",
        ])
        out.append(Prompt(form, True, "arithmetic"))
    return out


def training_prompts(seed: int = 0) -> list[Prompt]:
    """Every training prompt, shuffled deterministically (a budget cut keeps a varied prefix)."""
    rng = random.Random(seed)
    ps = [Prompt(t.format(t=topic), True, "chat") for topic in TOPICS for t in CHAT_TEMPLATES]
    ps += [Prompt(f"Write a Python function that {task}.", True, "code") for task in CODE_TASKS]
    ps += [Prompt(f"Write a JavaScript function that {task}.", True, "code") for task in CODE_TASKS[:8]]
    ps += _arithmetic(rng, 40)
    ps += [Prompt(c, False, "continuation") for c in CONTINUATIONS]
    ps += [Prompt(f"Q: What is {topic}?\nA:", False, "continuation") for topic in TOPICS[:30]]
    rng.shuffle(ps)
    return ps


def held_out_prompts() -> list[Prompt]:
    """Prompts for measuring acceptance: topics, tasks and openings unseen in training."""
    ps = [Prompt(t.format(t=topic), True, "chat") for i, topic in enumerate(HELD_OUT_TOPICS)
          for t in HELD_OUT_CHAT_TEMPLATES[i % 2:i % 2 + 1]]
    ps += [Prompt(f"Write a Python function that {task}.", True, "code") for task in HELD_OUT_CODE_TASKS]
    ps += [Prompt("What is 37 + 48 * 3? Show your steps.", True, "arithmetic")]
    ps += [Prompt(c, False, "continuation") for c in HELD_OUT_CONTINUATIONS]
    return ps
