"""Tool-call parsers of every family: several calls, text around them, a cut call, malformed calls (content, never
an error), and the "auto" stream equal to the non-streamed answer at every cut point."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.entrypoints.openai import tool_parsers as tp

W = '{"city": "Paris"}'


def calls_of(parser_name: str, text: str):
    """``(content, [(name, arguments)])``, arguments parsed when they are valid JSON (else the text)."""
    ex = tp.get_tool_parser(parser_name).extract(text)
    return ex.content, [(c.name, _loads(c.arguments)) for c in ex.tool_calls]


def _loads(s: str):
    try:
        return json.loads(s)
    except ValueError:
        return s


CASES = [
    # hermes
    ("hermes", '<tool_call>{"name": "w", "arguments": ' + W + '}</tool_call>', (None, [("w", {"city": "Paris"})])),
    ("hermes", 'Sure.\n<tool_call>{"name": "w", "arguments": {}}</tool_call>\n<tool_call>{"name": "v", '
               '"arguments": {"a": 1}}</tool_call>', ("Sure.", [("w", {}), ("v", {"a": 1})])),
    ("hermes", "<tool_call>{bad json</tool_call>", ("<tool_call>{bad json</tool_call>", [])),
    ("hermes", 'A\n<tool_call>{"nam": 1}</tool_call>\n<tool_call>{"name": "v", "arguments": {}}</tool_call>\nDone.',
     ('A\n<tool_call>{"nam": 1}</tool_call>\nDone.', [("v", {})])),
    ("hermes", '<tool_call>{"name": "w", "arguments": {"a": "x\\"}"}}</tool_call',
     ("</tool_call", [("w", {"a": 'x"}'})])),
    # llama3_json
    ("llama3_json", '{"name": "w", "parameters": ' + W + '}', (None, [("w", {"city": "Paris"})])),
    ("llama3_json", '<|python_tag|>{"name": "w", "parameters": {}}; {"name": "v", "arguments": {"x": [1]}}',
     (None, [("w", {}), ("v", {"x": [1]})])),
    ("llama3_json", 'Let me check.\n<|python_tag|>{"name": "w", "parameters": {}}', ("Let me check.", [("w", {})])),
    # a committed call stays a call: text after it is content, a cut call keeps the arguments read so far
    ("llama3_json", ' {"name": "w", "parameters": {}} trailing', ("trailing", [("w", {})])),
    ("llama3_json", '{"name": "w", "parameters": {"city": "Pa', (None, [("w", '{"city": "Pa')])),
    ("llama3_json", '{"name": "w", "parameters": {"city": "Pa" oops}', ("oops}", [("w", '{"city": "Pa" ')])),
    ("llama3_json", '{"parameters": {"a": 1}, "name": "w"}', (None, [("w", {"a": 1})])),  # read whole
    ("llama3_json", "The answer is {x}.", ("The answer is {x}.", [])),
    ("llama3_json", '{"answer": 4}', ('{"answer": 4}', [])),
    # pythonic
    ("pythonic", '[get_weather(city="Paris"), f(x=1, y=[1, 2], z=None)]',
     (None, [("get_weather", {"city": "Paris"}), ("f", {"x": 1, "y": [1, 2], "z": None})])),
    ("pythonic", "  [f()]\n", (None, [("f", {})])),
    ("pythonic", "[f(1)]", ("[f(1)]", [])),
    ("pythonic", "[f(x=g())]", ("[f(x=g())]", [])),
    ("pythonic", '[f(x="a"), g(', ("g(", [("f", {"x": "a"})])),
    ("pythonic", '[f(x="a", y=g())]', ("y=g())]", [("f", '{"x": "a"')])),
    ("pythonic", "[f(x=(1, 2), y='it''s', z={'k': True},)]",
     (None, [("f", {"x": [1, 2], "y": "its", "z": {"k": True}})])),
    ("pythonic", "Call [f(x=1)]", ("Call [f(x=1)]", [])),
    ("pythonic", "[1, 2]", ("[1, 2]", [])),
    # mistral
    ("mistral", '[TOOL_CALLS][{"name": "w", "arguments": ' + W + '}, {"name": "v", "arguments": {}}]',
     (None, [("w", {"city": "Paris"}), ("v", {})])),
    ("mistral", "Checking.[TOOL_CALLS]w[ARGS]" + W + "[TOOL_CALLS]v[ARGS]{}",
     ("Checking.", [("w", {"city": "Paris"}), ("v", {})])),
    ("mistral", "[TOOL_CALLS]w[CALL_ID]abc123XYZ[ARGS]{}", (None, [("w", {})])),
    ("mistral", "[TOOL_CALLS]w[ARGS]{\"city\": ", (None, [("w", '{"city": ')])),
    ("mistral", "[TOOL_CALLS]w[ARGS]", ("[TOOL_CALLS]w[ARGS]", [])),
    # granite
    ("granite", '<|tool_call|>[{"name": "w", "arguments": ' + W + '}]', (None, [("w", {"city": "Paris"})])),
    ("granite", 'Ok <|tool_call|>[{"name": "w", "arguments": {}}, {"name": "v", "arguments": {"b": true}}]',
     ("Ok", [("w", {}), ("v", {"b": True})])),
    ("granite", '<|tool_call|>[{"name": "w"', ('<|tool_call|>[{"name": "w"', [])),
    # phi4_mini_json
    ("phi4_mini_json", 'functools[{"name": "w", "arguments": ' + W + '}]', (None, [("w", {"city": "Paris"})])),
    ("phi4_mini_json", 'I will.functools[{"name": "w", "parameters": {}}, {"name": "v", "arguments": {}}]',
     ("I will.", [("w", {}), ("v", {})])),
    ("phi4_mini_json", 'functools[{"nam": "w"}]', ('functools[{"nam": "w"}]', [])),
]


def stream(parser_name: str, text: str, cuts) -> tuple:
    """``(content, [(name, arguments)])`` joined from the pieces of ``text`` cut at ``cuts``; checks the pieces'
    shape on the way (a call's first piece has its id and name, later ones only arguments)."""
    streamer = tp.AutoToolStreamer(tp.get_tool_parser(parser_name))
    bounds = [0] + sorted(set(c for c in cuts if 0 < c < len(text))) + [len(text)]
    content, calls = "", {}
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        for piece in streamer.feed(text[a:b], final=k == len(bounds) - 2):
            if isinstance(piece, str):
                content += piece
            elif piece.index not in calls:
                assert piece.id and piece.name and piece.index == len(calls)
                calls[piece.index] = [piece.name, piece.arguments]
            else:
                assert piece.id is None and piece.name is None and piece.arguments
                calls[piece.index][1] += piece.arguments
    return content or None, [(n, a) for n, a in calls.values()]


def raw_calls(parser_name: str, text: str):
    ex = tp.get_tool_parser(parser_name).extract(text)
    return ex.content, [(c.name, c.arguments) for c in ex.tool_calls]


@pytest.mark.parametrize("name,text,expected", CASES)
def test_extract_and_stream_at_every_cut(name, text, expected):
    assert calls_of(name, text) == expected
    whole = raw_calls(name, text)
    for cut in range(len(text) + 1):
        assert stream(name, text, [cut]) == whole
    assert stream(name, text, range(len(text))) == whole


def pieces(streamer, delta, final=False):
    return [p if isinstance(p, str) else (p.index, p.name, p.arguments) for p in streamer.feed(delta, final)]


def test_content_and_calls_stream_as_the_text_arrives():
    s = tp.AutoToolStreamer(tp.get_tool_parser("mistral"))
    assert pieces(s, "Checking the weather. [TOOL") == ["Checking the weather."]
    assert pieces(s, "_CALLS]w[ARGS]") == []  # the name is read, the arguments not begun: not committed yet
    assert pieces(s, '{"city": "Pa') == [(0, "w", '{"city": "Pa')]
    assert pieces(s, 'ris"}') == [(0, None, 'ris"}')]
    assert pieces(s, "", final=True) == []
    s = tp.AutoToolStreamer(tp.get_tool_parser("llama3_json"))
    assert pieces(s, "  ") == [] and pieces(s, "Hi") == ["  Hi"]  # not a lead "{": content flows
    s = tp.AutoToolStreamer(tp.get_tool_parser("hermes"))
    assert pieces(s, '<tool_call>\n{"name": "get_weather", "arguments": ') == []
    assert pieces(s, '{"city"') == [(0, "get_weather", '{"city"')]
    assert pieces(s, ': "Paris"}}\n</tool_call>\n<tool_call>{"name": "f", "arguments": {}}') == [
        (0, None, ': "Paris"}'), (1, "f", "{}")]
    # pythonic: a fragment per keyword argument, JSON
    s = tp.AutoToolStreamer(tp.get_tool_parser("pythonic"))
    assert pieces(s, '[get_weather(city="Par') == []
    assert pieces(s, 'is", days=') == [(0, "get_weather", '{"city": "Paris"')]
    assert pieces(s, "3)") == [(0, None, ', "days": 3}')]
    assert pieces(s, ", now(") == [] and pieces(s, ")]") == [(1, "now", "{}")]


def test_registry_and_template_choice():
    assert {"hermes", "llama3_json", "pythonic", "mistral", "granite", "phi4_mini_json"} <= set(
        tp.tool_parser_names())
    assert tp.parser_for_template("{% for t in tools %}<tool_call>{% endfor %}")[0] == "hermes"
    assert tp.parser_for_template("{{ tools }} <|python_tag|>")[0] == "llama3_json"
    assert tp.parser_for_template("{{ tools }} [TOOL_CALLS]")[0] == "mistral"
    assert tp.parser_for_template("{{ tools }} <|tool_call|>")[0] == "granite"
    assert tp.parser_for_template("{{ tools }} functools[")[0] == "phi4_mini_json"
    assert tp.parser_for_template("{{ tools }} [func_name1(params_name1=params_value1)]")[0] == "pythonic"
    assert tp.parser_for_template("{{ messages }}")[0] == "hermes"  # no tools in the template: the fallback prompt
    name, why = tp.parser_for_template("{{ tools }} <tool_call> [TOOL_CALLS]")
    assert name is None and "several" in why
    assert tp.parser_for_template("{{ tools }}")[0] is None


PIECES = st.sampled_from(["<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]", "<|tool_call|>",
                          "functools", "[ARGS]", '{"name": "f", "arguments": {}}', '{"name": "g", "parameters": {}}',
                          "[", "]", "{", "}", ";", ", ", "f(x=1)", " ", "\n", "Hi", "<", "tool",
                          '{"name": "f", "arguments": ', '"a"', ": ", "1", "true", "f(", "x=", ")", '"', "\\",
                          "[TOOL_CALLS]f[ARGS]", "=", "'s'"])


@settings(max_examples=600, deadline=None)
@given(parts=st.lists(PIECES, max_size=14), cuts=st.lists(st.integers(0, 150), max_size=6),
       name=st.sampled_from(["hermes", "llama3_json", "pythonic", "mistral", "granite", "phi4_mini_json"]))
def test_stream_equals_extract_for_any_text_and_cuts(parts, cuts, name):
    text = "".join(parts)
    assert stream(name, text, cuts) == raw_calls(name, text)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "granite", "phi4_mini_json", "pythonic"])
def test_tool_choice_grammar_is_the_parsers_own_format(name):
    """"required" / named in a parser's format: the grammar accepts the format's calls of the tools (and nothing
    else: not the JSON path's list, not an unknown function, not arguments outside the schema, not a second call
    when one is asked), and the parser reads what it accepts (pythonic: Python literals, read back as JSON)."""
    xgt = pytest.importorskip("xgrammar.testing")
    import xgrammar as xgr

    parser = tp.get_tool_parser(name)
    if name == "pythonic":
        opener, sep, closer = "[", ", ", "]"

        def call(fn, args):
            return fn + "(" + ", ".join(f"{k}={json.dumps(v)}" for k, v in json.loads(args).items()) + ")"
    else:
        opener, begin, end, sep, closer = parser.call_format

        def call(fn, args):
            return begin.replace("NAME", json.dumps(fn)) + args + end

    def accepts(constraint, text):
        (kind, value), = constraint.items()
        g = (xgr.Grammar.from_ebnf(value) if kind == "grammar" else
             xgr.Grammar.from_structural_tag(json.dumps(value)))
        return xgt._is_grammar_accept_string(g, text)

    tag = parser.choice_constraint(TOOLS, "required", None)

    two = opener + call("get_weather", '{"city": "Paris"}') + sep + call("now", "{}") + closer
    assert accepts(tag, two)
    assert calls_of(name, two) == (None, [("get_weather", {"city": "Paris"}), ("now", {})])
    assert not accepts(tag, '[{"name": "now", "arguments": {}}]')
    assert not accepts(tag, opener + call("other", "{}") + closer)
    assert not accepts(tag, opener + call("get_weather", '{"town": "Paris"}') + closer)
    one = parser.choice_constraint(TOOLS, "required", False)
    assert accepts(one, opener + call("now", "{}") + closer) and not accepts(one, two)
    named = parser.choice_constraint(TOOLS, {"type": "function", "function": {"name": "now"}}, None)
    assert accepts(named, opener + call("now", "{}") + closer)
    assert not accepts(named, opener + call("get_weather", '{"city": "Paris"}') + closer)
    assert parser.choice_constraint(TOOLS, "auto", None) is None
    with pytest.raises(ValueError, match="tool_choice"):
        parser.choice_constraint(TOOLS, {"type": "function", "function": {"name": "nope"}}, None)


def test_pythonic_grammar_writes_python_literals_and_falls_back_to_json():
    """Python's True / None and nested values under the schema; a property that is not an identifier: no grammar
    (the JSON path)."""
    xgt = pytest.importorskip("xgrammar.testing")
    import xgrammar as xgr

    parser = tp.get_tool_parser("pythonic")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "on": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", None]}},
        "n": {"type": "integer"}}, "required": ["n"]}}}]
    g = xgr.Grammar.from_ebnf(parser.choice_constraint(tools, "required", None)["grammar"])
    text = '[f(n=2, on=True, tags=["a", None]), f(n=-1)]'
    assert xgt._is_grammar_accept_string(g, text)
    assert calls_of("pythonic", text) == (None, [("f", {"n": 2, "on": True, "tags": ["a", None]}), ("f", {"n": -1})])
    assert not xgt._is_grammar_accept_string(g, "[f(n=2, on=true)]")  # JSON's literal is not Python's
    assert not xgt._is_grammar_accept_string(g, "[f(on=True)]")  # n is required
    dashed = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "max-n": {"type": "integer"}}}}}]
    assert parser.choice_constraint(dashed, "required", None) is None


def test_auto_tool_choice_error_says_exactly_what_is_needed():
    """"auto" without ``--enable-auto-tool-choice``: the flag alone when the template implies a parser; with no
    parser known, ``--tool-call-parser`` too; each API's own alternatives."""
    from kvserve.entrypoints.openai.errors import OpenAIError
    from kvserve.entrypoints.openai.serving_chat import ToolChoice

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]

    def message(**kw):
        with pytest.raises(OpenAIError) as e:
            ToolChoice.create(tools, None, **kw)
        assert e.value.param == "tool_choice"
        return e.value.message

    flag_only = message(parser="hermes", auto_enabled=False)
    assert "--enable-auto-tool-choice" in flag_only and "--tool-call-parser NAME" not in flag_only
    assert "'hermes'" in flag_only and 'tool_choice "required", "none" or a named function' in flag_only
    both = message(parser=None, auto_enabled=False)
    assert "--enable-auto-tool-choice and --tool-call-parser NAME" in both
    parser_only = message(parser=None, auto_enabled=True)
    assert "--tool-call-parser NAME" in parser_only and "--enable-auto-tool-choice" not in parser_only
    anthropic = message(parser="hermes", auto_enabled=False, alternatives="X")
    assert anthropic.endswith("; or send X")
    assert ToolChoice.create(tools, None, parser="hermes", auto_enabled=True).choice == "auto"
