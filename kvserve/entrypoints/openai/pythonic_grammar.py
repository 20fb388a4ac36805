"""The grammar of a forced ``tool_choice`` in the pythonic format: ``[f(a=1, b="x"), g()]`` whose keyword arguments
follow each tool's ``parameters`` schema as Python literals.

Each property's value grammar is xgrammar's own JSON-schema grammar (``Grammar.from_json_schema``, compact JSON) with
its rules renamed apart and JSON's ``true`` / ``false`` / ``null`` written as Python's ``True`` / ``False`` /
``None``; the rest of JSON's value syntax (numbers, double-quoted strings, lists, dicts with string keys) is Python
literal syntax already, so ``ast.literal_eval`` reads what the grammar writes (``tool_scan.python_call_list``).
Keyword arguments come in the schema's order: the required ones, then any of the optional ones.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

#: an EBNF token: a string literal, a character class, an identifier, or any other character
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*|\s+|.', re.DOTALL)
_PYTHON = {'"true"': '"True"', '"false"': '"False"', '"null"': '"None"'}


def value_rules(schema: Any, prefix: str) -> list[str]:
    """EBNF rules for a Python literal valid under JSON ``schema``; the start rule is ``{prefix}root``.

    Raises:
        ValueError: xgrammar cannot convert the schema (its message).
    """
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True))
    lines = [line for line in text.splitlines() if "::=" in line]
    names = {line.split("::=", 1)[0].strip() for line in lines}
    out = []
    for line in lines:
        head, body = line.split("::=", 1)
        tokens = [prefix + t if t in names else _PYTHON.get(t, t) for t in _TOKEN.findall(body)]
        out.append(f"{prefix}{head.strip()} ::={''.join(tokens)}")
    return out


def pythonic_grammar(tools: list[dict], names: list[str], single: bool) -> Optional[str]:
    """The EBNF (start rule ``root``) of ``[call, ...]`` over the functions ``names`` of OpenAI ``tools``; one call
    when ``single``. ``None`` when a function or property name is not a Python identifier (no keyword argument can
    carry it) or a schema is not an object's (the JSON path then).

    Raises:
        ValueError: a ``parameters`` schema xgrammar cannot convert.
    """
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    rules, calls = [], []
    for i, name in enumerate(names):
        schema = params[name]
        props = schema.get("properties") or {}
        if not name.isidentifier() or not isinstance(props, dict) or not all(k.isidentifier() for k in props):
            return None
        required = [k for k in props if k in (schema.get("required") or [])]
        optional = [k for k in props if k not in required]
        kwargs = {}
        for j, key in enumerate(props):
            prefix = f"t{i}_p{j}_"
            rules += value_rules(props[key], prefix)
            kwargs[key] = f"{json.dumps(key + '=')} {prefix}root"
        args = " \", \" ".join(kwargs[k] for k in required)
        if required:
            args += "".join(f' (", " {kwargs[k]})?' for k in optional)
        elif optional:
            alts = [kwargs[k] + "".join(f' (", " {kwargs[o]})?' for o in optional[n + 1:])
                    for n, k in enumerate(optional)]
            args = "(" + " | ".join(f"({a})" for a in alts) + ")?"
        rules.append(f"call_{i} ::= {json.dumps(name + '(')} {args or chr(34) * 2} \")\"")
        calls.append(f"call_{i}")
    rules.append("call ::= " + " | ".join(calls))
    rules.append('root ::= "[" call "]"' if single else 'root ::= "[" call (", " call)* "]"')
    return "\n".join(rules)
