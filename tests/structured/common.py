"""Shared by the structured-output tests: a fixed subset of the BFCL multi-turn tool schemas (../shared/data), as
standard JSON schemas, and a validator."""

import json

import pytest

from kvserve.bench.workloads import default_data_dir

BFCL_DIR = default_data_dir() / "bfcl_multi_turn" / "multi_turn_func_doc"

#: (file, function) pairs: strings, numbers, integers, arrays, booleans, optional fields
BFCL_FUNCTIONS = [("message_api.json", "send_message"), ("posting_api.json", "post_tweet"),
                  ("math_api.json", "add"), ("vehicle_control.json", "lockDoors"),
                  ("trading_bot.json", "place_order")]

_TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


#: bounds added to every string / array, so that a 135M model's greedy run-ons ("1234567890123...") end in time
MAX_LENGTH, MAX_ITEMS = 16, 3


def to_json_schema(s):
    """BFCL's parameter schema -> JSON schema (``dict`` -> ``object``, ``float`` -> ``number``, ``tuple`` ->
    ``array``, ``any`` -> no type), as BFCL's own OpenAI converter does; strings get ``maxLength``, arrays
    ``maxItems`` (``MAX_LENGTH``, ``MAX_ITEMS``)."""
    if isinstance(s, list):
        return [to_json_schema(x) for x in s]
    if not isinstance(s, dict):
        return s
    out = {}
    for k, v in s.items():
        if k == "type":
            t = _TYPES.get(v, v)
            if t is not None:
                out[k] = t
            if t == "string":
                out["maxLength"] = MAX_LENGTH
            if t == "array":
                out["maxItems"] = MAX_ITEMS
        elif k == "properties":
            out[k] = {name: to_json_schema(sub) for name, sub in v.items()}
        elif k == "items":
            out[k] = to_json_schema(v)
        elif k != "response":
            out[k] = v
    return out


def bfcl_tools():
    """The fixed subset as OpenAI tools ``[{"type": "function", "function": {name, description, parameters}}]``."""
    if not BFCL_DIR.is_dir():
        pytest.skip(f"BFCL tool schemas not found at {BFCL_DIR}")
    tools = []
    for fname, func in BFCL_FUNCTIONS:
        for line in (BFCL_DIR / fname).read_text().splitlines():
            d = json.loads(line)
            if d["name"] == func:
                tools.append({"type": "function", "function": {
                    "name": d["name"], "description": d["description"][-200:],
                    "parameters": to_json_schema(d["parameters"])}})
    assert len(tools) == len(BFCL_FUNCTIONS)
    return tools


def assert_valid(instance, schema):
    """``instance`` validates against ``schema`` (jsonschema, Draft 2020-12)."""
    import jsonschema

    jsonschema.Draft202012Validator(schema).validate(instance)
