"""Structured outputs: a grammar (JSON schema, any JSON object, regex, choice, EBNF) constrains what a request may
generate. ``params`` says what to enforce, ``schema_check`` refuses JSON-schema features the backend would
silently ignore, ``backend`` compiles grammars once per engine (xgrammar), makes one ``GrammarState`` (a
matcher) per sample, which the scheduler advances and turns into each planned row's token bitmask
(``plan_bitmask``), and applies bitmasks to logits inside the samplers (``apply_bitmask``)."""

from kvserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
