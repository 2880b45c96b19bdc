"""The structured-output workload: 60 (JSON schema, prompt) pairs, with one valid instance per schema.

Twelve record kinds (people, books, products, ...) in five schema shapes each (flat, with an enum, with an array,
nested, with optional and nullable fields), each asked for by its own prompt. Strings carry a maxLength, numbers
a range and a step (multipleOf 0.25), so every constrained answer ends within the token budget: a small model left
free writes a string, or a fraction's digits, until max_tokens cuts it (the default model wrote "au":
1.0000000000000001234567890000... for 200 tokens), and a cut answer is not valid JSON. The step is one binary
floating point holds exactly: `jsonschema` checks multipleOf in floats, so with 0.01 it rejects valid answers
(30.33 / 0.01 = 3032.9999999999995). `example(schema)` builds the instance the
grammar-engine benchmark tokenizes.
"""

from __future__ import annotations

from typing import Any

KINDS = {
    "person": ("a person", {"name": "string", "age": "integer", "city": "string"}, ["engineer", "teacher", "artist"]),
    "book": ("a book", {"title": "string", "author": "string", "year": "integer"}, ["novel", "poetry", "essay"]),
    "product": ("a product in an online shop", {"name": "string", "price": "number", "stock": "integer"},
                ["toys", "garden", "kitchen"]),
    "city": ("a city", {"name": "string", "country": "string", "population": "integer"},
             ["capital", "port", "village"]),
    "movie": ("a movie", {"title": "string", "director": "string", "minutes": "integer"},
              ["drama", "comedy", "horror"]),
    "recipe": ("a cooking recipe", {"dish": "string", "servings": "integer", "minutes": "integer"},
               ["starter", "main", "dessert"]),
    "weather": ("today's weather report", {"place": "string", "celsius": "number", "wind_kmh": "integer"},
                ["sunny", "rainy", "cloudy"]),
    "order": ("a customer order", {"customer": "string", "total": "number", "items": "integer"},
              ["pending", "shipped", "delivered"]),
    "employee": ("an employee record", {"name": "string", "team": "string", "salary": "integer"},
                 ["junior", "senior", "lead"]),
    "event": ("a concert event", {"artist": "string", "venue": "string", "tickets": "integer"},
              ["indoor", "outdoor", "online"]),
    "car": ("a used car for sale", {"make": "string", "model": "string", "km": "integer"},
            ["petrol", "diesel", "electric"]),
    "planet": ("a planet of the solar system", {"name": "string", "moons": "integer", "au": "number"},
               ["rocky", "gas", "ice"]),
}
SHAPES = ("flat", "enum", "array", "nested", "optional")


def _field(kind: str) -> dict[str, Any]:
    if kind == "string":
        return {"type": "string", "minLength": 1, "maxLength": 24}
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "maximum": 100000}
    return {"type": "number", "minimum": -1000, "maximum": 100000, "multipleOf": 0.25}


def schema_for(kind: str, shape: str) -> dict[str, Any]:
    _, fields, labels = KINDS[kind]
    props = {k: _field(t) for k, t in fields.items()}
    if shape == "enum":
        props["category"] = {"type": "string", "enum": labels}
    elif shape == "array":
        props["tags"] = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3}
    elif shape == "nested":
        props = {kind: {"type": "object", "properties": props, "required": list(props), "additionalProperties": False},
                 "verified": {"type": "boolean"}}
    required = list(props)
    if shape == "optional":
        props["note"] = {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]}
        required = list(fields)[:2] + ["note"]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def prompt_for(kind: str, shape: str) -> str:
    what, fields, labels = KINDS[kind]
    extra = {"flat": "", "enum": f" Its category is one of {', '.join(labels)}.",
             "array": " Add up to three short tags.", "nested": f" Put the record under the key \"{kind}\" and say "
             "whether it is verified.", "optional": " Add a short note, or null."}[shape]
    return f"Describe {what} as a JSON object with the fields {', '.join(fields)}.{extra} Answer with JSON only."


def example(schema: dict[str, Any]) -> Any:
    """A small valid instance of `schema` (first enum value, one array item, the first anyOf branch)."""
    if "enum" in schema:
        return schema["enum"][0]
    if "anyOf" in schema:
        return example(schema["anyOf"][0])
    t = schema.get("type")
    if t == "object":
        return {k: example(v) for k, v in schema["properties"].items()}
    if t == "array":
        return [example(schema["items"])]
    if t == "string":
        return "abc"
    if t == "integer":
        return 42
    if t == "number":
        return 3.5
    if t == "boolean":
        return True
    return None


CASES = [{"id": f"{kind}-{shape}", "schema": schema_for(kind, shape), "prompt": prompt_for(kind, shape),
          "example": example(schema_for(kind, shape))} for kind in KINDS for shape in SHAPES]
