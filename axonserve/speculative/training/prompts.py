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
    # thousands of distinct contexts, so the head learns the model rather than memorising a few hundred
    "the Ottoman Empire", "ancient Greece", "the Cold War", "the Aztecs", "the Vikings", "the Ming dynasty",
    "the American Civil War", "the Black Death", "the invention of the telephone", "the steam engine",
    "the Apollo program", "the Hubble Space Telescope", "Mars rovers", "comets", "exoplanets", "the Big Bang",
    "neutron stars", "gravity", "magnetism", "electricity", "light", "sound waves", "thermodynamics", "atoms",
    "the periodic table", "chemical reactions", "acids and bases", "polymers", "crystals", "nanotechnology",
    "genetics", "evolution", "cells", "bacteria", "viruses", "fungi", "the nervous system", "the digestive system",
    "muscles", "bones", "the lungs", "blood", "allergies", "diabetes", "exercise", "running", "yoga", "swimming",
    "football", "basketball", "tennis", "cricket", "baseball", "golf", "cycling races", "marathons", "skiing",
    "surfing", "rock climbing", "camping", "hiking", "fishing", "birdwatching", "astronomy as a hobby",
    "knitting", "woodworking", "pottery", "painting", "sculpture", "architecture", "Gothic cathedrals",
    "skyscrapers", "bridges", "tunnels", "railways", "high-speed trains", "ships", "ports", "canals", "highways",
    "traffic", "city planning", "public transport", "housing", "rent", "mortgages", "taxes", "banks",
    "credit cards", "budgeting", "saving money", "investing", "retirement", "insurance", "small businesses",
    "startups", "marketing", "advertising", "supply chains", "shipping containers", "trade", "globalization",
    "tourism", "hotels", "restaurants", "fast food", "pizza", "sushi", "cheese", "wine", "beer", "spices",
    "vegetarian diets", "farming", "irrigation", "soil", "wheat", "rice", "corn", "potatoes", "apples",
    "bananas", "oranges", "forests", "deserts", "wetlands", "rivers", "lakes", "oceans", "islands", "caves",
    "waterfalls", "weather forecasts", "clouds", "rain", "snow", "lightning", "tornadoes", "droughts", "floods",
    "wildfires", "air pollution", "plastic waste", "biodiversity", "endangered species", "elephants", "lions",
    "wolves", "bears", "dolphins", "sharks", "octopuses", "butterflies", "ants", "spiders", "frogs", "owls",
    "eagles", "parrots", "cats", "dogs", "horses", "cows", "chickens", "pets", "zoos", "national parks",
    "museums", "theaters", "movies", "television", "radio", "podcasts", "newspapers", "books", "poetry",
    "novels", "Shakespeare", "Greek mythology", "fairy tales", "comic books", "video games", "board games",
    "card games", "puzzles", "magic tricks", "music theory", "the guitar", "the violin", "drums", "orchestras",
    "opera", "rock music", "hip hop", "classical music", "dance", "ballet", "fashion", "cotton", "silk",
    "languages", "grammar", "learning a second language", "writing essays", "public speaking", "debate",
    "philosophy", "ethics", "logic", "psychology", "memory", "emotions", "motivation", "habits", "happiness",
    "friendship", "family", "parenting", "childhood", "teenagers", "old age", "education", "homework",
    "exams", "universities", "online courses", "teachers", "scientific method", "statistics", "probability",
    "algebra", "geometry", "calculus", "prime numbers", "fractions", "percentages", "graphs", "maps",
    "compasses", "GPS", "satellites", "rockets", "drones", "3D printing", "virtual reality", "artificial intelligence",
    "computer programming", "operating systems", "databases", "cloud computing", "cybersecurity", "passwords",
    "email", "social media", "search engines", "open source software", "computer chips", "transistors",
    "the transistor radio", "lasers", "fiber optics", "wireless networks", "5G", "data centers", "encryption",
    "privacy", "law", "courts", "elections", "human rights", "the United Nations", "charities", "volunteering",
    "immigration", "cities", "villages", "castles", "pyramids", "temples", "festivals", "holidays", "birthdays",
    "weddings", "gift giving", "manners", "time management", "procrastination", "remote work", "job interviews",
    "resumes", "leadership", "teamwork", "negotiation", "customer service", "nursing", "doctors", "hospitals",
    "first aid", "dentists", "eyesight", "hearing", "stress", "laughter", "dreams", "colors", "numbers",
    "clocks", "calendars", "seasons", "spring", "summer", "autumn", "winter", "sunsets", "the night sky",
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
    "What is {t}?", "Tell me about {t}.", "Write a blog post introduction about {t}.",
    "Explain {t} in simple terms.", "Write a limerick about {t}.", "What is the future of {t}?",
    "Give me a step-by-step guide to learning about {t}.", "Compare {t} with something from everyday life.",
    "Write a short dialogue between two friends discussing {t}.", "What would happen if {t} disappeared?",
    "Write a persuasive paragraph about why {t} matters.", "Create a quiz with three questions about {t}.",
    "Write an email to a friend about {t}.", "What are the most important ideas behind {t}?",
    "Describe a day in the life of someone who works with {t}.", "Give me a fun fact about {t}.",
    "Write a product description inspired by {t}.", "Explain {t} using an analogy.",
    "What should a beginner know about {t}?", "Write a news headline and a short article about {t}.",
    "List the key terms related to {t} with short definitions.", "Write a motivational speech that mentions {t}.",
    "How has {t} changed over the last hundred years?", "Write a children's story about {t}.",
]
HELD_OUT_CHAT_TEMPLATES = ["Teach me the basics of {t}.", "Why should anyone care about {t}?"]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "computes the factorial of n", "merges two sorted lists",
    "counts the vowels in a string", "returns the n-th Fibonacci number", "removes duplicates from a list",
    "finds the largest element in a list", "checks whether a string is a palindrome", "flattens a nested list",
    "converts Celsius to Fahrenheit", "sorts a list of dictionaries by a key", "computes the mean of a list",
    "reads a text file and counts its words", "implements binary search", "transposes a matrix",
    "adds two matrices", "counts word frequencies in a text", "checks whether two strings are anagrams",
    "returns the second largest number in a list", "converts a decimal number to binary", "capitalizes every word",
    "computes the sum of the digits of a number", "finds the common elements of two lists", "rotates a list by k",
    "validates an email address", "generates all permutations of a string", "computes the power set of a set",
    "implements a queue with two stacks", "finds the longest word in a sentence", "computes compound interest",
    "checks whether a year is a leap year", "counts the lines in a file", "parses a CSV line into fields",
    "returns the median of a list", "implements bubble sort", "implements insertion sort", "implements merge sort",
    "computes the distance between two points", "converts a string to title case", "groups words by length",
    "returns the n smallest numbers", "checks whether a list is sorted", "computes the least common multiple",
    "removes whitespace from a string", "finds the index of an item in a list", "zips two lists into a dictionary",
    "simulates rolling a die", "computes the area of a circle", "counts the occurrences of a character",
]
CODE_LANGUAGES = ["Python", "JavaScript", "Java", "C++", "Go", "Rust"]
HELD_OUT_CODE_TASKS = ["computes the greatest common divisor of two numbers", "checks whether brackets are balanced"]
CONTINUATIONS = [
    "Once upon a time, in a small village by the sea,", "The recipe is simple. First,",
    "def fibonacci(n):\n", "import numpy as np\n\n", "The main reason people enjoy travelling is",
    "Q: What is the capital of France?\nA:", "In 1969, the world watched as", "Dear hiring manager,\n\n",
    "The three laws of thermodynamics are", "class Stack:\n    def __init__(self):\n",
    "Step 1: Preheat the oven to 180 degrees.\nStep 2:", "It was a dark and stormy night;",
    "The history of mathematics begins with", "Here is a list of tips for staying productive:\n1.",
    "Breaking news: scientists have discovered", "SELECT name, age FROM users WHERE",
    "The best way to learn a new skill is", "Chapter 1\n\nThe morning sun rose over", "My favourite memory is",
    "Introduction\n\nIn recent years,", "def main():\n", "for i in range(10):\n", "#include <stdio.h>\n\nint main",
    "function add(a, b) {\n", "The city was quiet that evening, except for", "Ingredients:\n- 2 cups of flour\n-",
    "To whom it may concern,\n\n", "The experiment began when", "Abstract: We study", "Once there was a robot who",
    "The top five reasons to exercise are:\n1.", "Question: Why is the sky blue?\nAnswer:",
    "Monday morning started badly for", "In conclusion,", "The old map showed a path through", "Hello! My name is",
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
    ps += [Prompt(f"Write a {lang} function that {task}.", True, "code") for task in CODE_TASKS
           for lang in CODE_LANGUAGES]
    ps += _arithmetic(rng, 600)
    ps += [Prompt(c, False, "continuation") for c in CONTINUATIONS]
    ps += [Prompt(f"Q: What is {topic}?\nA:", False, "continuation") for topic in TOPICS]
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
