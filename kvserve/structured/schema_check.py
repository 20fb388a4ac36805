"""Refuse JSON-schema features the grammar backend would not enforce (xgrammar 0.2 accepts and silently ignores
them, so the output could violate the schema the client sent). Everything else — types, ``properties``,
``required``, ``additionalProperties``, ``items`` / ``prefixItems``, ``minItems`` / ``maxItems``, ``enum``,
``const``, ``anyOf`` / ``oneOf``, local ``$ref`` (``#/...``), string ``pattern`` / ``minLength`` / ``maxLength``,
numeric bounds — is enforced."""

from __future__ import annotations

from typing import Any

from kvserve.validation import ParamError

#: keyword -> why it is refused (the message of the ``ValueError``).
UNSUPPORTED_KEYWORDS = {
    "not": "'not' (schema negation)",
    "if": "'if' / 'then' / 'else' (conditional schemas)",
    "then": "'if' / 'then' / 'else' (conditional schemas)",
    "else": "'if' / 'then' / 'else' (conditional schemas)",
    "uniqueItems": "'uniqueItems'",
    "contains": "'contains'",
    "minContains": "'minContains'",
    "maxContains": "'maxContains'",
    "dependentRequired": "'dependentRequired'",
    "dependentSchemas": "'dependentSchemas'",
    "dependencies": "'dependencies'",
    "unevaluatedItems": "'unevaluatedItems'",
    "$dynamicRef": "'$dynamicRef'",
    "$recursiveRef": "'$recursiveRef'",
}

# keywords whose value is a schema, a list of schemas, or a name -> schema map (walked recursively)
_SCHEMA = ("items", "additionalProperties", "additionalItems", "propertyNames", "unevaluatedProperties")
_SCHEMA_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_MAP = ("properties", "patternProperties", "$defs", "definitions")


def check_json_schema(schema: Any, path: str = "structured_outputs.json") -> None:
    """Walk ``schema`` and raise on the first unsupported feature.

    Raises:
        ParamError: (field ``path``) ``"<path>: unsupported JSON schema feature <feature>"``, e.g. for ``not``, ``if``,
            ``uniqueItems``, ``contains``, ``dependentRequired``, an ``allOf`` of more than one schema, or a
            ``$ref`` outside the document (not ``#`` / ``#/...``); or a subschema that is not an object/boolean.
    """
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ParamError.of(path, f": a JSON schema must be an object or a boolean, got {type(schema).__name__}")
    for key, value in schema.items():
        if key in UNSUPPORTED_KEYWORDS:
            raise ParamError.of(path, f": unsupported JSON schema feature {UNSUPPORTED_KEYWORDS[key]}")
        if key == "$ref" and not (isinstance(value, str) and (value == "#" or value.startswith("#/"))):
            raise ParamError.of(path, f": unsupported JSON schema feature '$ref' to {value!r} (only references "
                             f"inside the schema, '#/...', are supported)")
        if key == "allOf" and isinstance(value, list) and len(value) > 1:
            raise ParamError.of(path, f": unsupported JSON schema feature 'allOf' with more than one schema")
        if key in _SCHEMA_LIST + ("items",) and isinstance(value, list):  # (draft-4 tuple ``items`` too)
            for i, sub in enumerate(value):
                check_json_schema(sub, f"{path}.{key}[{i}]")
        elif key in _SCHEMA:
            check_json_schema(value, f"{path}.{key}")
        elif key in _SCHEMA_MAP and isinstance(value, dict):
            for name, sub in value.items():
                check_json_schema(sub, f"{path}.{key}.{name}")
