"""A larger project corpus: the output formats that structured workloads ask for (JSON arrays, JSON Lines, CSV to
JSON, configs; fill-in templates, YAML, SQL INSERTs, INI / .env blocks, form letters; Markdown READMEs, changelogs,
checklists, FAQs, tables; code in several languages; everyday questions), composed from lists written for verispec.

`corpus.project_prompts()` is the small set the shipped drafters were first trained on; this module adds 853
prompts, 164-176 per kind (PER_KIND caps a kind), so that self-distillation data sees each format many times with
different subjects. No prompt shares an 8-word run with a benchmark prompt (tests/test_train_data.py).
Deterministic: a fixed seed picks the combinations.
"""

from __future__ import annotations

import itertools
import random

from verispec.train.corpus import interleave

PER_KIND = 200
NAMES = ["Ava", "Noah", "Mei", "Omar", "Lena", "Ravi", "Sofia", "Kwame", "Ines", "Tariq", "Hana", "Pablo", "Zoe",
         "Ivan", "Amara", "Felix", "Yuki", "Dara", "Elif", "Marco"]
CITIES = ["Lima", "Oslo", "Hanoi", "Accra", "Quito", "Riga", "Porto", "Perth", "Dakar", "Kyoto", "Bergen", "Cusco",
          "Malmo", "Tunis", "Graz", "Leeds", "Pune", "Cebu"]
RECORDS = [
    ("invoice", ["invoice_id", "client", "amount", "due_date", "paid"]),
    ("vehicle", ["plate", "make", "model", "year", "electric"]),
    ("shipment", ["tracking_id", "origin", "destination", "weight_kg", "delivered"]),
    ("course", ["code", "title", "credits", "instructor", "online"]),
    ("appointment", ["appointment_id", "patient", "doctor", "date", "confirmed"]),
    ("server", ["hostname", "ip", "os", "cpu_cores", "active"]),
    ("podcast episode", ["episode", "title", "guest", "minutes", "published"]),
    ("job posting", ["job_id", "title", "company", "salary_min", "remote"]),
    ("warehouse item", ["sku", "name", "quantity", "location", "reorder"]),
    ("train departure", ["train", "destination", "platform", "time", "delayed"]),
    ("restaurant", ["name", "cuisine", "rating", "price_level", "open_late"]),
    ("user account", ["user_id", "username", "email", "created", "verified"]),
    ("log event", ["ts", "level", "service", "message", "code"]),
    ("weather forecast", ["date", "city", "high_c", "low_c", "rain_chance"]),
    ("video game", ["title", "platform", "year", "players", "multiplayer"]),
    ("library member", ["member_id", "name", "joined", "books_out", "fines"]),
    ("smart device", ["device_id", "type", "firmware", "battery", "online"]),
    ("museum exhibit", ["exhibit_id", "title", "era", "room", "on_loan"]),
    ("bank transfer", ["transfer_id", "sender", "receiver", "amount", "settled"]),
    ("conference talk", ["talk_id", "speaker", "track", "minutes", "recorded"]),
]
FILL = [  # (items' name, items, template fields)
    ("instrument", ["violin", "oboe", "sitar", "tuba", "banjo", "harp"], ["Instrument", "Family", "Origin"]),
    ("river", ["Nile", "Danube", "Mekong", "Volga", "Zambezi", "Rhine"], ["River", "Continent", "Flows into"]),
    ("vegetable", ["carrot", "leek", "okra", "beet", "kale", "pea"], ["Vegetable", "Colour", "Eaten raw"]),
    ("sport", ["rugby", "curling", "fencing", "polo", "rowing", "judo"], ["Sport", "Players per side", "Equipment"]),
    ("mountain", ["Denali", "Elbrus", "Aconcagua", "Kilimanjaro", "Fuji", "Matterhorn"],
     ["Mountain", "Country", "Height (m)"]),
    ("currency", ["yen", "rand", "peso", "krona", "rupee", "dirham"], ["Currency", "Country", "Symbol"]),
    ("programming language", ["Haskell", "Ruby", "Kotlin", "Lua", "Perl", "Elixir"],
     ["Language", "First released", "Typical use"]),
    ("metal", ["copper", "zinc", "tin", "nickel", "cobalt", "silver"], ["Metal", "Chemical symbol", "Common use"]),
    ("bird", ["puffin", "heron", "kestrel", "robin", "toucan", "albatross"], ["Bird", "Habitat", "Diet"]),
    ("tree", ["oak", "birch", "cedar", "maple", "willow", "baobab"], ["Tree", "Leaf type", "Where it grows"]),
    ("dance", ["tango", "waltz", "samba", "flamenco", "polka", "salsa"], ["Dance", "Origin", "Time signature"]),
    ("cheese", ["brie", "gouda", "feta", "cheddar", "gruyere", "paneer"], ["Cheese", "Country", "Milk"]),
    ("constellation", ["Orion", "Lyra", "Cygnus", "Draco", "Perseus", "Aquila"], ["Name", "Brightest star", "Season"]),
    ("inventor", ["Tesla", "Curie", "Edison", "Lovelace", "Bell", "Franklin"], ["Person", "Known for", "Century"]),
]
SERVICES = ["auth", "billing", "search", "gateway", "mailer", "reports", "uploads", "metrics", "orders", "chat"]
APPS = ["a recipe app", "a fitness tracker", "a school portal", "a parking service", "a ticket shop",
        "a note-taking tool", "a weather dashboard", "a pet-sitting marketplace", "a home-energy monitor",
        "a library catalogue", "a delivery tracker", "a photo backup service"]
TOOLS = ["dirwatch", "csvlint", "imgsort", "logzip", "mdtoc", "httpcheck", "dupfind", "tzconv", "pwgen-lite",
         "gitstats", "yamlfix", "diskpeek", "urlshort", "cronview", "jsondiff", "snapkeep"]
DOCS = [
    ("README", ["Overview", "Installation", "Usage", "Configuration", "License"]),
    ("README", ["What it does", "Install", "Examples", "FAQ", "Contributing"]),
    ("user guide", ["Getting started", "Everyday tasks", "Settings", "Troubleshooting"]),
    ("design note", ["Problem", "Goals", "Proposal", "Alternatives", "Open questions"]),
    ("runbook", ["Purpose", "Alerts", "Diagnosis", "Recovery", "Escalation"]),
]
EVENTS = ["a school science fair", "a charity run", "a company picnic", "a book club meeting", "a wedding reception",
          "a product launch", "a neighbourhood clean-up", "a hackathon", "a camping weekend", "a garage sale",
          "a piano recital", "a team offsite"]
BUSINESSES = ["a yoga studio", "a bicycle rental", "a vegan cafe", "an escape room", "a tutoring service",
              "a laundromat", "a ferry company", "a plant nursery", "a car wash", "a co-working space"]
FUNCS = [
    ("reverse_words", "reverses the order of the words in a sentence"),
    ("is_anagram", "checks whether two strings are anagrams of each other"),
    ("gcd", "returns the greatest common divisor of two integers"),
    ("flatten_dict", "flattens a nested dictionary into dotted keys"),
    ("rotate_list", "rotates a list to the right by k places"),
    ("count_words", "counts the words in a text"),
    ("to_snake_case", "converts a camelCase name to snake_case"),
    ("median", "returns the median of a list of numbers"),
    ("unique_chars", "checks whether every character of a string is unique"),
    ("sum_digits", "sums the digits of a non-negative integer"),
    ("group_by_length", "groups words into a dictionary keyed by their length"),
    ("roman_to_int", "converts a Roman numeral to an integer"),
    ("pairwise_sums", "returns the sums of neighbouring items of a list"),
    ("clamp", "limits a number to a given minimum and maximum"),
    ("title_case", "capitalises the first letter of every word"),
    ("find_duplicates", "returns the items that appear more than once in a list"),
    ("leap_year", "tells whether a year is a leap year"),
    ("max_subarray", "returns the largest sum of a contiguous sub-list"),
    ("hex_to_rgb", "turns a colour like '#ff8800' into an (r, g, b) tuple"),
    ("word_lengths", "maps each word of a sentence to its length"),
]
LANGS = ["Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C#", "Ruby"]
CLASSES = [("Queue", "enqueue, dequeue and size"), ("BankAccount", "deposit, withdraw and balance"),
           ("Inventory", "add_item, remove_item and total_count"), ("Rectangle", "area, perimeter and is_square"),
           ("Playlist", "add_song, remove_song and duration"), ("Thermostat", "set_target, read and is_heating"),
           ("ShoppingCart", "add, remove and total"), ("Library", "add_book, lend and available")]
SCHEMAS = [("employees(id, name, dept_id, salary)", "departments(id, name)"),
           ("students(id, name, class_id)", "grades(student_id, subject, score)"),
           ("products(id, name, price, category)", "sales(id, product_id, qty, sold_at)"),
           ("authors(id, name, country)", "books(id, author_id, title, year)")]
CONCEPTS = ["inflation", "gravity", "a blockchain", "the immune system", "electric cars", "tides", "compound words",
            "volcanoes", "the stock market", "vaccines", "black holes", "recycling", "the internet", "jet lag",
            "earthquakes", "photosynthesis in desert plants", "interest rates", "magnets", "DNA", "clouds"]
AUDIENCES = ["to a child", "in two paragraphs", "with an everyday example", "to someone new to the topic",
             "in simple words", "as a short list of key points"]
ACTIVITIES = ["learning to swim", "saving money on groceries", "running a first 5k", "keeping a journal",
              "learning to draw", "planning a road trip", "starting a vegetable garden", "public speaking",
              "working night shifts", "studying for exams", "reducing screen time", "cooking for one"]
PAIRS = [("a comet", "an asteroid"), ("a crocodile", "an alligator"), ("baking soda", "baking powder"),
         ("a latte", "a cappuccino"), ("a hurricane", "a tornado"), ("RAM", "storage"), ("a fruit", "a vegetable"),
         ("a credit card", "a debit card"), ("a frog", "a toad"), ("an ocean", "a sea"), ("a virus", "a worm"),
         ("empathy", "sympathy")]
FORMS = ["a haiku", "a limerick", "a short story", "a four-line poem", "a short fable", "a diary entry"]
SUBJECTS = ["a lighthouse keeper", "a lost umbrella", "the first snow", "a city bus at night", "an old map",
            "a curious fox", "a kite on a windy day", "a quiet library"]


def _cols(keys: list[str]) -> str:
    return ", ".join(f'"{k}"' for k in keys)


def _json(rng: random.Random) -> list[str]:
    out = []
    for (entity, keys), n in itertools.product(RECORDS, (3, 4, 5, 7)):
        out.append(rng.choice([
            f"Produce a JSON array of {n} {entity} objects with the fields {_cols(keys)}. Print only the array.",
            f"Give {n} example {entity} entries as a JSON array; each entry uses the keys {_cols(keys)} and no others.",
            f"Output {n} lines of JSON Lines, one {entity} per line, with the keys {_cols(keys)}.",
        ]))
    for (entity, keys), app in zip(RECORDS, itertools.cycle(APPS)):
        for n in (3, 6):
            out.append(f"Write a JSON object for {app} with the key \"items\" holding {n} {entity} records (keys "
                       f"{_cols(keys)}), plus \"count\" and \"generated_at\". Nothing but JSON.")
    for (entity, keys), n in itertools.product(RECORDS, (2, 5)):
        rows = "\n".join(",".join([f"{keys[0][:3].upper()}-{100 + i}"] + [str(rng.randint(1, 99)) for _ in keys[1:]])
                         for i in range(1, n + 1))
        out.append(f"Turn these {entity} rows into a JSON array of objects (numbers stay numbers):\n\n"
                   f"{','.join(keys)}\n{rows}")
    for app in APPS:
        secs = rng.sample(["server", "database", "logging", "cache", "email", "features", "limits"], 3)
        out.append(f"Write a JSON configuration object for {app} with the sections {', '.join(secs)}; give each "
                   "section three settings with realistic values. Only the JSON.")
    return out


def _templates(rng: random.Random) -> list[str]:
    out = []
    for (what, items, fields), k in itertools.product(FILL, (3, 4, 5, 6)):
        body = "\n".join(f"{f}: <{f.lower()}>" for f in fields)
        out.append(f"Use this template once for each {what}: {', '.join(rng.sample(items, k))}.\n\n{body}\n---")
    for i in range(30):
        svc = rng.sample(SERVICES, rng.choice([3, 4, 5]))
        ports = [8000 + rng.randint(1, 99) for _ in svc]
        shape = rng.choice(["- service: <name>\n  port: <port>\n  healthcheck: /<name>/health",
                            "<name>:\n  listen: <port>\n  workers: 4\n  log: /var/log/<name>.log",
                            "[service.<name>]\nport = <port>\nenabled = true",
                            "<NAME>_PORT=<port>\n<NAME>_HOST=<name>.internal"])
        out.append(f"Write one block per service in exactly this shape:\n\n{shape}\n\nServices: "
                   + ", ".join(f"{s} on {p}" for s, p in zip(svc, ports)))
    for (entity, keys), i in itertools.product(RECORDS, range(2)):
        rows = "\n".join(" | ".join([f"{k}-{rng.randint(10, 99)}" for k in keys[:2]] + [str(rng.randint(1, 500))
                                   for _ in keys[2:]]) for _ in range(4))
        out.append(f"Write one SQL INSERT statement per row for the table {entity.replace(' ', '_')}s"
                   f"({', '.join(keys)}):\n\n{rows}")
    for i in range(50):
        people = rng.sample(NAMES, rng.choice([3, 4]))
        form = rng.choice([
            ("table booking", "Hi <name>,\nyour table for <people> is booked on <day> at <time>.\nSee you soon!"),
            ("class reminder", "Hello <name>,\nyour <course> class starts on <date> in room <room>.\nBring a pen."),
            ("parcel notice", "Dear <name>,\nparcel <code> is waiting at the <place> desk until <date>."),
            ("log line", "[<level>] <time> <component>: <message>"),
            ("commit message", "<type>: <short summary>\n\n<one line of detail>"),
        ])
        out.append(f"Write a {form[0]} for each of {', '.join(people)} using this template, inventing the "
                   f"details:\n\n{form[1]}")
    return out


def _markdown(rng: random.Random) -> list[str]:
    out = []
    for tool, (kind, secs) in itertools.product(TOOLS, DOCS):
        if rng.random() < 0.75:
            out.append(f"Write a Markdown {kind} for \"{tool}\", a small command-line program. Give it the level-2 "
                       f"headings {', '.join(secs)}, in that order.")
    for tool in TOOLS:
        vs = sorted(rng.sample(range(1, 9), 3), reverse=True)
        out.append(f"Write a changelog in Markdown for \"{tool}\" covering versions " +
                   ", ".join(f"{v}.{rng.randint(0, 5)}.0" for v in vs) +
                   ". One level-2 heading per version with a date, then Added, Changed and Fixed lists.")
    for ev in EVENTS:
        out.append(f"Make a Markdown checklist with \"- [ ]\" items for organising {ev}, grouped under three "
                   "level-3 headings of your choice.")
        out.append(f"Write the agenda for {ev} in Markdown: a title, a table with Time, Item and Owner, then "
                   "a short Notes section.")
    for b in BUSINESSES:
        out.append(f"Write a Markdown FAQ page for {b}: six questions as level-3 headings, each answered in one or "
                   "two sentences.")
        out.append(f"Create a Markdown price list for {b} as a table with the columns Service, Duration, Price, "
                   "and a bold note under it.")
    for concept in CONCEPTS:
        out.append(f"Write a Markdown glossary of 6 terms related to {concept}, each as \"**term**: definition\" "
                   "on its own line, sorted alphabetically.")
    for app in APPS:
        out.append(f"Write a Markdown incident postmortem for an outage of {app}, with the level-2 headings "
                   "Summary, Timeline, Root Cause, Lessons and Action Items.")
        out.append(f"Write a weekly status report in Markdown for the team building {app}: headings Shipped, "
                   "Next, Risks, with 3 bullets each.")
    return out


def _code(rng: random.Random) -> list[str]:
    out = []
    for (name, what), lang in itertools.product(FUNCS, LANGS):
        if rng.random() < 0.7:
            out.append(rng.choice([
                f"In {lang}, write a function `{name}` that {what}. Add a comment block and two example calls.",
                f"Implement `{name}` in {lang}: it {what}. Show the code, then a few lines that test it.",
            ]))
    for name, what in FUNCS:
        out.append(f"Write pytest tests for a Python function `{name}` that {what}: cover normal input, empty "
                   "input and one tricky case.")
    for (cls, methods), lang in itertools.product(CLASSES, ("Python", "Java", "TypeScript")):
        out.append(f"Write a {lang} class `{cls}` with the methods {methods}, with short comments.")
    for (a, b), q in itertools.product(SCHEMAS, ("the count per group", "the top 3 by total", "rows with no match")):
        out.append(f"Given the SQL tables {a} and {b}, write a query that returns {q}, and explain it in a sentence.")
    return out


def _chat(rng: random.Random) -> list[str]:
    out = [f"Explain {c} {a}." for c in CONCEPTS for a in rng.sample(AUDIENCES, 4)]
    out += [f"Give me {n} practical tips for {act}." for act in ACTIVITIES for n in (3, 5)]
    out += [f"How is {a} different from {b}?" for a, b in PAIRS]
    out += [f"Write {f} about {s}." for f in FORMS for s in rng.sample(SUBJECTS, 4)]
    out += [f"What are the advantages and drawbacks of {act}?" for act in ACTIVITIES]
    out += [f"What should a beginner know before {act}?" for act in ACTIVITIES]
    return out


def format_prompts(per_kind: int = PER_KIND) -> list[dict]:
    """[{"id", "kind", "prompt"}]: up to per_kind prompts of each kind, kinds interleaved round-robin."""
    rng = random.Random(20261205)
    kinds = {"json_records": _json, "templates": _templates, "markdown": _markdown, "code": _code, "chat": _chat}
    picked = {}
    for kind, make in kinds.items():
        prompts = list(dict.fromkeys(make(rng)))  # distinct, in order
        rng.shuffle(prompts)
        picked[kind] = prompts[:per_kind]
    return interleave(picked, "verispec-fmt")
