"""How much one request may carry beyond its prompt, and how a client's value is quoted back in an error.

The bounds are what a user needs, small enough that no request's bookkeeping costs the others; past one, the
request gets a 400 naming the field (protocol.py). A value or field name quoted in an error is cut short: a client
may send a megabyte where a number or a name belongs.
"""

from __future__ import annotations

import json
from typing import Any, Callable

# what one request may carry beyond its prompt: enough for any real use, small enough that no request's bookkeeping
# costs the others (a 2M-entry stop_token_ids list once stalled every stream; issue 67)
MAX_STOP_TOKEN_IDS = 256
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # per stop string: it is searched in the output text after every commit
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits
MAX_ECHOED_NAME = 64  # characters of an unknown field name quoted back in an error

BadRequest = Callable[..., Exception]  # (message, param) -> the 400 to raise (protocol.bad_request)


def shown(v: Any, most: int = 80) -> str:
    """A client's value as quoted back in an error: its JSON when short, else what it is and how big (never the
    whole of a megabyte list)."""
    if isinstance(v, (list, dict)) and len(v) > 16:
        return f"a JSON {_json_type(v)} of {len(v)} entries"
    text = json.dumps(v)
    return text if len(text) <= most else f"{text[:most]}... ({len(text)} characters)"


def echo_name(name: str) -> str:
    """A client's field name as quoted back: at most MAX_ECHOED_NAME characters."""
    return name if len(name) <= MAX_ECHOED_NAME else f"{name[:MAX_ECHOED_NAME]}... ({len(name)} characters)"


def check_bookkeeping(body: dict, bad_request: BadRequest) -> None:
    """OpenAI's `user` (a string) and `metadata` (up to 16 string keys of 64 characters, string values of 512):
    unused by generation, but held to OpenAI's types and sizes so a request cannot park anything in them."""
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request(f"'user' must be a string (an id of your end user), got a JSON {_json_type(user)}.",
                          "user")
    meta = body.get("metadata")
    if meta is None:
        return
    if not isinstance(meta, dict):
        raise bad_request(f"'metadata' must be an object of string keys and values, got a JSON {_json_type(meta)}.",
                          "metadata")
    if len(meta) > MAX_METADATA_KEYS:
        raise bad_request(f"'metadata' holds {len(meta)} keys; send at most {MAX_METADATA_KEYS}.", "metadata")
    for k, v in meta.items():
        if len(k) > MAX_METADATA_KEY_CHARS:
            raise bad_request(f"'metadata' key {echo_name(k)!r} is longer than {MAX_METADATA_KEY_CHARS} characters.",
                              "metadata")
        if not isinstance(v, str) or len(v) > MAX_METADATA_VALUE_CHARS:
            raise bad_request(f"'metadata.{echo_name(k)}' must be a string of at most {MAX_METADATA_VALUE_CHARS} "
                              "characters.", f"metadata.{echo_name(k)}")


def _json_type(v: Any) -> str:
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "array", dict: "object"}
    return "null" if v is None else names.get(type(v), type(v).__name__)
