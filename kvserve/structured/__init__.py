"""Structured outputs: a grammar (JSON schema, any JSON object, regex, choice, EBNF) constrains what a request may
generate. ``params`` says what to enforce, ``schema_check`` refuses JSON-schema features the backend would
silently ignore, ``backend`` compiles grammars once per engine (xgrammar) and makes one ``GrammarState`` (a
matcher) per sample, ``mask`` fills and applies the batched token bitmask inside the samplers."""

from kvserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
