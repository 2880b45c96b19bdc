"""The project's own training prompts: structured tasks (JSON records, fill-in templates, Markdown documents, code)
and everyday chat questions, composed from templates and subject lists written for verispec.

They cover the kinds of task the shipped benchmark workloads measure without reusing any benchmark prompt
(tests/test_train_data.py checks there is no overlap). Deterministic: the same `n` gives the same prompts.
Public prompt sets (`{"turns": [...]}` JSONL, such as DeepSpec's eval prompts) can be added as files.
"""

from __future__ import annotations

import itertools
import random

ENTITIES = [
    ("book", ["title", "author", "year", "pages", "genre"]),
    ("employee", ["employee_id", "name", "department", "salary", "remote"]),
    ("sensor reading", ["sensor", "timestamp", "temperature", "humidity", "ok"]),
    ("movie", ["title", "director", "year", "rating", "runtime_min"]),
    ("order", ["order_id", "customer", "total", "currency", "shipped"]),
    ("recipe", ["name", "cuisine", "minutes", "servings", "vegetarian"]),
    ("flight", ["flight", "from", "to", "departure", "gate"]),
    ("student", ["student_id", "name", "grade", "average", "enrolled"]),
    ("planet", ["name", "moons", "radius_km", "has_rings", "type"]),
    ("bug report", ["id", "title", "severity", "component", "open"]),
    ("song", ["title", "artist", "album", "seconds", "explicit"]),
    ("hotel", ["name", "city", "stars", "price_per_night", "pool"]),
]
TOPICS = ["a bakery", "a bike-repair shop", "a city library", "a weather station", "a small bookshop", "a dentist",
          "a football club", "a language school", "a garden centre", "a railway museum", "a pet shelter", "a cinema",
          "a coffee roaster", "a climbing gym", "a music festival", "a farmers' market"]
TOOLS = ["pathsync", "logtail", "csvmerge", "imgshrink", "notedown", "pingwatch", "todoq", "dotbackup", "jsonfmt",
         "portscan-lite", "mdlinkcheck", "envcheck"]
COUNTRIES = ["Kenya", "Peru", "Norway", "Vietnam", "Canada", "Egypt", "Chile", "Poland", "India", "Ghana", "Japan",
             "Portugal", "Mexico", "Finland", "Morocco", "Australia"]
FUNCS = [
    ("count_vowels(s: str) -> int", "counts the vowels in a string"),
    ("interleave(a: list, b: list) -> list", "alternates the items of two lists, then appends the rest"),
    ("chunk(xs: list, n: int) -> list[list]", "splits a list into chunks of size n"),
    ("is_prime(n: int) -> bool", "tests whether n is a prime number"),
    ("word_freq(text: str) -> dict[str, int]", "counts how often each word appears, ignoring case"),
    ("merge_sorted(a: list[int], b: list[int]) -> list[int]", "merges two sorted lists into one sorted list"),
    ("rle(s: str) -> str", "run-length encodes a string, e.g. 'aaab' -> 'a3b1'"),
    ("transpose(m: list[list[int]]) -> list[list[int]]", "transposes a matrix given as a list of rows"),
    ("celsius_to_fahrenheit(c: float) -> float", "converts Celsius to Fahrenheit"),
    ("dedupe(xs: list) -> list", "removes duplicates while keeping the first occurrence order"),
    ("binary_search(xs: list[int], target: int) -> int", "returns the index of target in a sorted list or -1"),
    ("parse_kv(line: str) -> dict[str, str]", "parses 'a=1;b=2' into a dictionary"),
    ("moving_average(xs: list[float], k: int) -> list[float]", "computes the moving average with window k"),
    ("caesar(s: str, shift: int) -> str", "applies a Caesar cipher to letters only"),
    ("second_largest(xs: list[int]) -> int", "returns the second largest distinct value"),
    ("validate_email(s: str) -> bool", "checks that a string looks like an email address"),
]
LANGS = ["Python", "JavaScript", "Python", "Rust", "Go", "Python", "TypeScript", "Bash"]
QUESTIONS = [
    "How do I start learning to play the guitar as an adult?", "How do meteorologists forecast rain several days ahead?",
    "Give me three tips for writing a clear email to a busy manager.", "Why do cats purr?",
    "How does compound interest work? Use a small example.", "What should I pack for a three-day hiking trip?",
    "Explain what a neural network is to a twelve-year-old.", "How can I make my mornings less rushed?",
    "What are the main causes of inflation?", "Suggest a simple weekly workout plan for a beginner.",
    "How do vaccines train the immune system?", "What is a good way to memorise vocabulary in a new language?",
    "Why is the ocean salty?", "How do I politely decline an invitation?", "What makes bread rise?",
    "Describe the water cycle in a few sentences.", "What are the pros and cons of working from home?",
    "How do solar panels produce electricity?", "Give me ideas for a birthday party on a small budget.",
    "Why do some medicines only work against certain infections?", "How can I improve my sleep?",
    "Explain recursion with an everyday analogy.", "What are some healthy snacks for work?",
    "How does a bill become a law in a parliament, in general terms?", "Why do leaves change colour in autumn?",
    "How do I keep houseplants alive?", "What is the greenhouse effect?", "How should I prepare for a job interview?",
    "What is the Pythagorean theorem used for in daily life?", "How do noise-cancelling headphones work?",
    "What are good habits for keeping a budget?", "Summarise the plot of a classic fairy tale of your choice.",
]


def _json_prompts(rng: random.Random) -> list[str]:
    out = []
    for (entity, keys), n in itertools.product(ENTITIES, (3, 4, 6)):
        ks = ", ".join(f'"{k}"' for k in keys)
        out.append(f"Create a JSON array with {n} {entity} records. Every record has exactly the keys {ks}. "
                   "Return only the JSON, nothing else.")
    for entity, keys in ENTITIES:
        out.append(f"Return a JSON object describing one {entity} with the fields {', '.join(keys)}, then a second "
                   f"object for another {entity}. Output a JSON list of the two objects only.")
    return out


def _template_prompts(rng: random.Random) -> list[str]:
    out = []
    for i in range(len(COUNTRIES)):
        cs = [COUNTRIES[(i + j) % len(COUNTRIES)] for j in range(4)]
        out.append("Fill in this template for each country: " + ", ".join(cs) +
                   ".\n\nCountry: <name>\nCapital: <capital>\nLanguage: <main language>\n---")
    for topic in TOPICS:
        out.append(f"Write 4 short customer reviews for {topic}, each in this exact format:\n"
                   "Reviewer: <first name>\nStars: <1-5>\nComment: <one sentence>\n---")
        out.append(f"Write a weekly schedule for {topic} using this format for each day Monday to Friday:\n"
                   "Day: <day>\nOpen: <time>\nClose: <time>\nNote: <short note>")
    return out


def _markdown_prompts(rng: random.Random) -> list[str]:
    out = []
    for tool in TOOLS:
        out.append(f"Write Markdown documentation for a command-line program named \"{tool}\". Use the level-2 "
                   "headings Overview, Install, Examples and Flags, and put the flags in a table.")
    for topic in TOPICS:
        out.append(f"Write a Markdown checklist for opening {topic} in the morning, grouped under three level-3 "
                   "headings.")
        out.append(f"Make a Markdown table of 5 items sold or offered by {topic} with columns Item, Price, Notes.")
    return out


def _code_prompts(rng: random.Random) -> list[str]:
    out = []
    for (sig, what), lang in zip(FUNCS, itertools.cycle(LANGS)):
        if lang == "Python":
            out.append(f"Write a Python function `{sig}` that {what}. Add a docstring and a few asserts as tests.")
        else:
            out.append(f"In {lang}, write a function that {what}. Include a short usage example.")
    for sig, what in FUNCS:
        out.append(f"Explain step by step how you would implement a function that {what}, then give the Python code.")
    return out


def project_prompts() -> list[dict]:
    """All project-written prompts: [{"id", "kind", "prompt"}], deterministic, kinds interleaved round-robin."""
    rng = random.Random(0)
    kinds = {"json_records": _json_prompts(rng), "templates": _template_prompts(rng),
             "markdown": _markdown_prompts(rng), "code": _code_prompts(rng), "chat": list(QUESTIONS)}
    return interleave(kinds, "verispec")


def interleave(kinds: dict[str, list[str]], prefix: str) -> list[dict]:
    """[{"id": f"{prefix}-{kind}-{i:03d}", "kind", "prompt"}], the kinds taken round-robin, so that any prefix of
    the list (a stopped data run) mixes every kind."""
    out = []
    for i in range(max(len(v) for v in kinds.values())):
        for kind, prompts in kinds.items():
            if i < len(prompts):
                out.append({"id": f"{prefix}-{kind}-{i:03d}", "kind": kind, "prompt": prompts[i]})
    return out
