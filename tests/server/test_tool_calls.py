"""Tool calls: format detection, whole and streamed parsing (which must agree on every split),
and the grammar that forces a call, compiled with llguidance on the default model's tokenizer."""

from __future__ import annotations

import json
import random
import re

import pytest

from pagecli.server.tool_calls import (
    FORMATS,
    StreamParser,
    Tags,
    ToolCall,
    auto_grammar,
    call_grammar,
    detect_format,
    detect_reasoning,
    get_format,
    parse,
)

# ---- chat template snippets (the parts that tell the families apart) -------------------------

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "assistant" and message.tool_calls %}
        {%- for tool_call in message.tool_calls %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
    {%- endif %}
{%- endfor %}"""

QWEN3 = (
    QWEN25
    + """
{%- if '</think>' in content %}
    {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1] %}
{%- endif %}
{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + \
'\\n</think>\\n\\n' + content.lstrip('\\n') }}"""
)

QWEN3_CODER = """{%- if tools is iterable and tools | length > 0 %}
    {{- "\\n\\n# Tools\\n\\nYou have access to the following functions:\\n\\n" }}
    {{- '<tools>' }}{%- for tool in tools %}{{- '\\n<function>\\n<name>' ~ tool.name ~ '</name>' }}
    {%- endfor %}{{- "\\n</tools>" }}
    {{- '\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\
\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\
\\n</parameter>\\n</function>\\n</tool_call>' }}
{%- endif %}
{%- for tool_call in message.tool_calls %}
    {{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
    {%- for args_name, args_value in tool_call.arguments|items %}
        {{- '<parameter=' + args_name + '>\\n' }}{{- args_value }}{{- '\\n</parameter>\\n' }}
    {%- endfor %}
    {{- '</function>\\n</tool_call>' }}
{%- endfor %}"""

LLAMA31 = """{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{%- if tools is not none and not tools_in_user_message %}
    {{- 'Given the following functions, please respond with a JSON for a function call with its \
proper arguments that best answers the given prompt.\\n\\n' }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name \
and its value}.' }}
{%- endif %}
{%- for message in messages %}
    {%- if 'tool_calls' in message %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
        {%- else %}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
    {%- endif %}
{%- endfor %}"""

LLAMA32 = """{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
{%- for tool in tools %}{{- tool | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{{- '{"name": "' + tool_call.name + '", ' }}
{{- '"parameters": ' }}
{{- tool_call.arguments | tojson }}"""

MISTRAL_V3 = """{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and (message == user_messages[-1]) %}
            {{- "[AVAILABLE_TOOLS] [" }}{{- "[/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {{- "[INST] " + message["content"] + "[/INST]" }}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- if not tool_call.id is defined or tool_call.id|length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric, length 9!") }}
            {%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "tool" %}
        {{- '[TOOL_RESULTS] {"content": ' + content|string + ", " }}
    {%- endif %}
{%- endfor %}"""

MISTRAL_V11 = """{%- for message in loop_messages %}
    {%- if message['role'] == 'assistant' and message['tool_calls'] %}
        {%- for tool in message['tool_calls'] %}
            {{- '[TOOL_CALLS]' + tool['function']['name'] + '[ARGS]' + tool['function']['arguments']|tojson }}
        {%- endfor %}
    {%- elif message['role'] == 'tool' %}
        {{- '[TOOL_RESULTS]' + message['content']|string + '[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}"""  # noqa: E501

LLAMA3_PLAIN = """{% set loop_messages = messages %}{% for message in loop_messages %}\
{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ \
message['content'] | trim + '<|eot_id|>' %}{{ content }}{% endfor %}"""

SMOLLM2 = """{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}\
{{ '<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
' }}{% endif %}{{'<|im_start|>' + message['role'] + '
' + message['content'] + '<|im_end|>' + '
'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant
' }}{% endif %}"""


@pytest.mark.parametrize(
    ("template", "fmt", "reasoning"),
    [
        (QWEN25, "hermes", False),
        (QWEN3, "hermes", True),
        (QWEN3_CODER, "qwen3_coder", False),
        (LLAMA31, "llama3_json", False),
        (LLAMA32, "llama3_json", False),
        (MISTRAL_V3, "mistral", False),
        (MISTRAL_V11, "mistral", False),
        (LLAMA3_PLAIN, None, False),
        (SMOLLM2, None, False),
        ("", None, False),
        (None, None, False),
    ],
)
def test_detect(template, fmt, reasoning):
    assert detect_format(template) == fmt
    assert detect_reasoning(template) is reasoning


def test_mistral_syntax_follows_the_template():
    assert not get_format("mistral", MISTRAL_V3).args_syntax
    assert get_format("mistral", MISTRAL_V11).args_syntax


# ---- tools and call texts ------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    },
]
NAMES = {"get_weather", "add"}
WEATHER = {"city": "Paris", "unit": "c"}
SUM = {"a": 2, "b": 40}


def render(fmt: str, name: str, args: dict) -> str:
    """One call the way the family's chat template writes it."""
    if fmt == "mistral":
        return "[TOOL_CALLS] " + json.dumps([{"name": name, "arguments": args}])
    if fmt == "hermes":
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
    if fmt == "llama3_json":
        return json.dumps({"name": name, "parameters": args})
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def render_many(fmt: str, calls: list[tuple[str, dict]]) -> str:
    """Several calls in one reply (Mistral's JSON syntax puts them in one list)."""
    if fmt == "mistral":
        return "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls])
    sep = "; " if fmt == "llama3_json" else "\n"
    return sep.join(render(fmt, n, a) for n, a in calls)


def calls_of(msg) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in msg.tool_calls]


ID_RE = {"mistral": r"[A-Za-z0-9]{9}"}  # Mistral's templates take nine letters and digits


def id_re(fmt: str) -> str:
    return ID_RE.get(fmt, r"call_[0-9a-f]{24}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_call(fmt):
    msg = parse(render(fmt, "get_weather", WEATHER), fmt, NAMES, tools=TOOLS)
    assert msg.content is None
    assert msg.reasoning_content is None
    assert calls_of(msg) == [("get_weather", WEATHER)]
    assert re.fullmatch(id_re(fmt), msg.tool_calls[0].id)


@pytest.mark.parametrize("fmt", FORMATS)
def test_brackets_and_quotes_inside_values(fmt):
    args = {"city": 'a "}]" {b\\'}
    msg = parse(render(fmt, "get_weather", args), fmt, NAMES)
    assert calls_of(msg) == [("get_weather", args)]


@pytest.mark.parametrize("fmt", FORMATS)
def test_several_calls(fmt):
    text = render_many(fmt, [("get_weather", WEATHER), ("add", SUM)])
    msg = parse(text, fmt, NAMES, tools=TOOLS)
    assert msg.content is None
    assert calls_of(msg) == [("get_weather", WEATHER), ("add", SUM)]
    assert len({c.id for c in msg.tool_calls}) == 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_content_before_calls(fmt):
    # llama3 JSON follows text only after its tag; a bare `{` mid-text is no call.
    opener = "<|python_tag|>" if fmt == "llama3_json" else ""
    text = "Let me look that up.\n" + opener + render(fmt, "get_weather", WEATHER)
    msg = parse(text, fmt, NAMES, tools=TOOLS)
    assert msg.content == "Let me look that up.\n"
    assert calls_of(msg) == [("get_weather", WEATHER)]


def test_hermes_text_between_and_after_calls():
    text = "A\n" + render("hermes", "add", SUM) + "\nB " + render("hermes", "add", SUM) + " C"
    msg = parse(text, "hermes", NAMES)
    assert msg.content == "A\n\nB  C"
    assert calls_of(msg) == [("add", SUM), ("add", SUM)]


def test_llama3_bare_json_mid_text_is_content():
    text = "Here: " + render("llama3_json", "add", SUM)
    assert parse(text, "llama3_json", NAMES) == parse(text, "llama3_json")
    msg = parse(text, "llama3_json")
    assert (msg.content, msg.tool_calls) == (text, [])


def test_llama3_json_answer_is_no_call():
    text = '{"name": "Alice", "age": 30}'  # a JSON reply that has a "name" but no parameters
    msg = parse(text, "llama3_json")
    assert (msg.content, msg.tool_calls) == (text, [])


def test_mistral_args_syntax_and_call_ids():
    text = (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}'
        '[TOOL_CALLS]add[CALL_ID]abcDEF123[ARGS]{"a": 2, "b": 40}'
    )
    msg = parse(text, "mistral", NAMES)
    assert msg.content is None
    assert calls_of(msg) == [("get_weather", WEATHER), ("add", SUM)]
    assert re.fullmatch(ID_RE["mistral"], msg.tool_calls[0].id)
    assert msg.tool_calls[1].id == "abcDEF123"  # the model's own id is kept
    listed = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 40}, "id": "k9x8y7w6v"}]'
    assert [c.id for c in parse(listed, "mistral", NAMES).tool_calls] == ["k9x8y7w6v"]


def test_qwen3_coder_values_follow_the_schema():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "n": {"type": "integer"},
                        "x": {"type": "number"},
                        "ok": {"type": "boolean"},
                        "opts": {"type": "object"},
                        "code": {"type": "string"},
                        "bad": {"type": "integer"},
                    },
                },
            },
        }
    ]
    body = {
        "n": "7",
        "x": "2.5",
        "ok": "True",
        "opts": '{"k": [1, 2]}',
        "code": "12\nif a < b:\n    pass",
        "bad": "many",
    }
    text = render("qwen3_coder", "f", body)
    typed = {"n": 7, "x": 2.5, "ok": True, "opts": {"k": [1, 2]}, "code": body["code"]}
    assert calls_of(parse(text, "qwen3_coder", tools=tools)) == [("f", {**typed, "bad": "many"})]
    # Without the schema every value is the text itself.
    assert calls_of(parse(text, "qwen3_coder")) == [("f", body)]


# ---- reasoning -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "reasoning", "content"),
    [
        ("<think>\nplan it\n</think>\n\nHello!", "\nplan it\n", "Hello!"),
        ("plan it</think>Hello!", "plan it", "Hello!"),  # the template opened <think>
        ("<think>still going", "still going", None),  # cut off while thinking
        ("<think>\n\n</think>\n\nHello!", None, "Hello!"),
        ("<think>a</think>b</think>c", "a", "b</think>c"),
    ],
)
def test_reasoning_split(text, reasoning, content):
    msg = parse(text, "hermes", reasoning=True)
    assert (msg.reasoning_content, msg.content, msg.tool_calls) == (reasoning, content, [])


@pytest.mark.parametrize("fmt", FORMATS)
def test_reasoning_then_call(fmt):
    inner = render(fmt, "add", {"a": 1, "b": 1})  # a call inside the thought is no call
    text = f"<think>\nmaybe {inner}\n</think>\n\n" + render(fmt, "get_weather", WEATHER)
    msg = parse(text, fmt, NAMES, reasoning=True, tools=TOOLS)
    assert msg.reasoning_content == f"\nmaybe {inner}\n"
    assert msg.content is None
    assert calls_of(msg) == [("get_weather", WEATHER)]


def test_reasoning_off_keeps_think_as_content():
    text = "<think>x</think>y"
    assert parse(text, "hermes") == parse(text, "hermes", reasoning=False)
    assert parse(text, "hermes").content == text


# ---- malformed calls stay content ------------------------------------------------------------

MALFORMED = {
    "hermes": [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',  # bad JSON
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',  # unknown tool
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n',  # never closed
        '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>',  # not an object
        "<tool_call>\n[1, 2]\n</tool_call>",
    ],
    "llama3_json": [
        '{"name": "get_weather", "parameters": {"city": "Paris",}}',
        '{"name": "rm_rf", "parameters": {}}',
        '{"name": "add", "parameters": {"a": 1, "b": 2}',
        '{"name": "add", "parameters": [1, 2]}',
        '<|python_tag|>brave_search.call(query="weather")',
        '<|python_tag|>{"name": "add", "parameters": "a=1"}',
    ],
    "mistral": [
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": }}]',  # bad JSON
        '[TOOL_CALLS] [{"name": "rm_rf", "arguments": {}}]',  # unknown tool
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "rm_rf", "arguments": {}}]',
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}',  # never closed
        '[TOOL_CALLS] {"name": "add", "arguments": {"a": 1}}',  # no list, no [ARGS]
        "[TOOL_CALLS] []",
        "[TOOL_CALLS]add[ARGS][1, 2]",  # arguments not an object
        '[TOOL_CALLS]add[ARGS]{"a": 1',
        "[TOOL_CALLS]add and more",
    ],
    "qwen3_coder": [
        "<tool_call>\n<function=rm_rf>\n<parameter=path>\n/\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</function>\n</tool_call>",
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</function>\n",
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=a>\n2\n"
        "</parameter>\n</function>\n</tool_call>",  # the same argument twice
        "<tool_call>\n<function=add>\nstray\n<parameter=a>\n1\n</parameter>\n</function>\n"
        "</tool_call>",
    ],
}


@pytest.mark.parametrize(("fmt", "text"), [(f, t) for f, texts in MALFORMED.items() for t in texts])
@pytest.mark.parametrize("prefix", ["", "Sure.\n"])
def test_malformed_call_is_content(fmt, text, prefix):
    msg = parse(prefix + text, fmt, NAMES, tools=TOOLS)
    assert msg.tool_calls == []
    assert msg.content == prefix + text


def test_malformed_call_beside_a_good_one():
    bad = MALFORMED["hermes"][0]
    good = render("hermes", "add", SUM)
    msg = parse(good + "\n" + bad, "hermes", NAMES)
    assert calls_of(msg) == [("add", SUM)]
    assert msg.content == "\n" + bad


def test_unknown_format():
    with pytest.raises(ValueError, match="not one of"):
        StreamParser("harmony")


def test_tool_call_shape():
    call = ToolCall(id="call_given", name="add", arguments='{"a": 1}')
    assert call.as_openai() == {
        "id": "call_given",
        "type": "function",
        "function": {"name": "add", "arguments": '{"a": 1}'},
    }
    assert ToolCall(name="a", arguments="{}").id != ToolCall(name="a", arguments="{}").id


# ---- streaming agrees with parse on every split ---------------------------------------------


def corpus() -> list[tuple[str, str, bool]]:
    cases = []
    for fmt in FORMATS:
        sep = "; " if fmt == "llama3_json" else "\n"
        one = render(fmt, "get_weather", WEATHER)
        tag = "<|python_tag|>" if fmt == "llama3_json" else ""
        cases += [
            (fmt, one, False),
            (fmt, "  " + render_many(fmt, [("get_weather", WEATHER), ("add", SUM)]) + "\n", False),
            (fmt, "Checking.\n" + tag + one, False),
            (fmt, "<think>\nhmm <tool_call> {x}\n</think>\n\n" + one, True),
            (fmt, "a < b and {c} <tool <|python <think [TOOL [x]", False),
            (fmt, render(fmt, "get_weather", {"city": 'a "}]" {b\\'}), False),
            (fmt, "<think>only thinking </thi", True),
            (fmt, "", True),
            (fmt, " \n ", False),
        ]
        cases += [(fmt, t, False) for t in MALFORMED[fmt]]
        cases += [(fmt, one + sep + t, False) for t in MALFORMED[fmt]]
    cases.append(("hermes", "A\n" + render("hermes", "add", SUM) + "\nB", False))
    cases.append(
        ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 2, "b": 40}[TOOL_CALLS]add[ARGS]{"a": 1}', False)
    )
    cases.append(
        ("mistral", 'So [TOOL_CALLS]add[CALL_ID]abcDEF123[ARGS]{"a": 2, "b": 4} ok', False)
    )
    return cases


def streamed(fmt: str, chunks: list[str], reasoning: bool) -> tuple[str, str, list]:
    """Content, reasoning and calls (ids left out: they are drawn anew each time)."""
    parser = StreamParser(fmt, NAMES, reasoning, tools=TOOLS)
    events = [e for c in chunks for e in parser.feed(c)] + parser.finish()
    content, thought, calls = "", "", []
    for e in events:
        assert len(e) == 1 and next(iter(e.values())), e
        content += e.get("content", "")
        thought += e.get("reasoning_content", "")
        for d in e.get("tool_calls", []):
            assert d["index"] == len(calls) and d["type"] == "function"
            assert re.fullmatch(id_re(fmt), d["id"]) or d["id"] == "abcDEF123"
            calls.append((d["function"]["name"], json.loads(d["function"]["arguments"])))
    return content, thought, calls


def splits(text: str, rng: random.Random) -> list[list[str]]:
    out = [[text], list(text)]
    out += [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(20 if len(text) > 1 else 0):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        out.append([text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])])
    return out


@pytest.mark.parametrize(("fmt", "text", "reasoning"), corpus())
def test_stream_matches_parse(fmt, text, reasoning):
    msg = parse(text, fmt, NAMES, reasoning, tools=TOOLS)
    want = (msg.content or "", msg.reasoning_content or "", calls_of(msg))
    for chunks in splits(text, random.Random(1234)):
        assert streamed(fmt, chunks, reasoning) == want, chunks


def feed_chars(parser: StreamParser, text: str) -> str:
    return "".join(e.get("content", "") for ch in text for e in parser.feed(ch))


@pytest.mark.parametrize("fmt", FORMATS)
def test_text_with_brackets_streams_through(fmt):
    parser = StreamParser(fmt, NAMES)
    text = "Use x < y, {braces} and <b>bold</b> here"
    assert feed_chars(parser, text) == text  # nothing held: no marker could start here
    partial = {"llama3_json": "<|pyt", "mistral": "[TOOL_C"}.get(fmt, "<tool")
    assert feed_chars(parser, " " + partial) == " "  # might become a call marker: held
    assert feed_chars(parser, "box>") == partial + "box>"
    assert parser.finish() == []


def test_llama3_holds_what_may_be_a_call():
    parser = StreamParser("llama3_json", NAMES)
    assert feed_chars(parser, ' {"name": "x"') == ""  # JSON at the start of the reply
    assert parser.finish() == [{"content": ' {"name": "x"'}]
    parser = StreamParser("llama3_json", NAMES)
    assert feed_chars(parser, "Hi <|pyth") == "Hi "
    assert feed_chars(parser, "on_tag|>") == ""
    assert feed_chars(parser, "no") == "<|python_tag|>no"


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder"])
def test_call_goes_out_when_it_closes(fmt):
    parser = StreamParser(fmt, NAMES, tools=TOOLS)
    text = render(fmt, "add", SUM)
    events = [e for ch in text[:-1] for e in parser.feed(ch)]
    assert events == []
    (event,) = parser.feed(text[-1])
    (delta,) = event["tool_calls"]
    assert delta["function"]["name"] == "add"
    assert json.loads(delta["function"]["arguments"]) == SUM


def test_reasoning_streams_as_it_comes():
    parser = StreamParser("hermes", NAMES, reasoning=True)
    assert parser.feed("<think>\nstep one") == [{"reasoning_content": "\nstep one"}]
    assert parser.feed(" </thi") == [{"reasoning_content": " "}]
    assert parser.feed("nk>\n\nDone") == [{"content": "Done"}]
    assert parser.finish() == []


# ---- grammars --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    import llguidance as llg

    from pagecli.config import EngineConfig
    from pagecli.loader.resolve import resolve_model

    path = resolve_model(EngineConfig().model).path / "tokenizer.json"
    return llg.LLTokenizer(path.read_text(), n_vocab=49152, eos_token=[2])


def accepts(tokenizer, lark: str, text: str) -> bool:
    import llguidance as llg

    matcher = llg.LLMatcher(tokenizer, llg.LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return bool(matcher.consume_tokens(tokenizer.tokenize_str(text))) and matcher.is_accepting()


def grammar_cases(fmt: str) -> tuple[list[str], list[str]]:
    """Texts a grammar for both tools must accept, and texts it must refuse."""
    good = [
        render(fmt, "get_weather", {"city": "Paris"}),
        render(fmt, "get_weather", WEATHER),
        render(fmt, "add", SUM),
        render_many(fmt, [("get_weather", WEATHER), ("add", SUM)]),
        render(fmt, "add", SUM) + "\n",  # a newline before the end of the turn
    ]
    bad = [
        render(fmt, "get_time", {"city": "Paris"}),  # no such tool
        render(fmt, "add", {"a": 2}),  # a required argument missing
        render(fmt, "add", {"a": "two", "b": 3}),  # not an integer
        render(fmt, "get_weather", {"city": "Paris", "unit": "kelvin"}),  # not in the enum
        "Sure! " + render(fmt, "add", SUM),  # text is no call
        "",
    ]
    if fmt == "qwen3_coder":
        good.append(render(fmt, "get_weather", {"city": "Saint-Denis <b>\nla Réunion"}))
        bad.append(render(fmt, "add", {"a": 2, "c": 3}))  # an argument it does not have
    else:
        bad.append(render(fmt, "get_weather", {"city": 3}))
    return good, bad


@pytest.mark.parametrize("fmt", FORMATS)
def test_grammar_any_tool(tokenizer, fmt):
    lark = call_grammar(fmt, TOOLS)
    good, bad = grammar_cases(fmt)
    for text in good:
        assert accepts(tokenizer, lark, text), text
        assert parse(text, fmt, NAMES, tools=TOOLS).tool_calls  # what it forces, parses
    for text in bad:
        assert not accepts(tokenizer, lark, text), text


@pytest.mark.parametrize("fmt", FORMATS)
def test_grammar_named_tool(tokenizer, fmt):
    lark = call_grammar(fmt, TOOLS, name="add")
    assert accepts(tokenizer, lark, render(fmt, "add", SUM))
    assert not accepts(tokenizer, lark, render(fmt, "get_weather", WEATHER))
    assert not accepts(tokenizer, lark, render_many(fmt, [("add", SUM), ("add", SUM)]))
    unparallel = call_grammar(fmt, TOOLS, parallel=False)
    assert accepts(tokenizer, unparallel, render(fmt, "add", SUM))
    assert not accepts(tokenizer, unparallel, render_many(fmt, [("add", SUM), ("add", SUM)]))


def test_grammar_tool_without_parameters(tokenizer):
    tools = [{"type": "function", "function": {"name": "now"}}]
    for fmt in FORMATS:
        args = {} if fmt != "qwen3_coder" else {"tz": "UTC"}
        assert accepts(tokenizer, call_grammar(fmt, tools), render(fmt, "now", args)), fmt


def test_grammar_errors():
    with pytest.raises(ValueError, match="not one of the tools"):
        call_grammar("hermes", TOOLS, name="nope")
    with pytest.raises(ValueError, match="at least one tool"):
        call_grammar("hermes", [])
    with pytest.raises(ValueError, match="not one of"):
        call_grammar("harmony", TOOLS)


# ---- tags that are single special tokens ---------------------------------------------------


@pytest.fixture(scope="module")
def tagged():
    """llguidance's view of a vocabulary whose tags are special tokens (tests/tool_tokenizer.py),
    and the tags as the engine's compiler finds them."""
    import llguidance as llg

    from pagecli.engine.structured import GrammarCompiler
    from pagecli.loader.resolve import float_checkpoint, resolve_model
    from tests.tool_tokenizer import TAGS, tool_tokenizer_json

    text = tool_tokenizer_json(float_checkpoint(resolve_model(None)))
    compiler = GrammarCompiler(text, 49152, [2], 5.0)
    found = compiler.special_ids([*TAGS, "<tool_call>x", "plain", "<|im_end|>"])
    compiler.close()
    assert found == {**TAGS, "<|im_end|>": 2}
    return llg.LLTokenizer(text, n_vocab=49152, eos_token=[2]), Tags(TAGS)


def tokens_accepted(tokenizer, lark: str, tokens: list[int]) -> bool:
    """Every token allowed by the mask and consumed, and the grammar complete after."""
    import llguidance as llg
    import numpy as np

    matcher = llg.LLMatcher(tokenizer, llg.LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    mask = np.zeros((49152 + 31) // 32, dtype=np.int32)
    for token in tokens:
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if not (int(mask[token // 32]) >> (token % 32)) & 1:
            return False
        assert matcher.consume_token(token), matcher.get_error()  # what the mask offers, goes
    return matcher.is_accepting()


def spelled(tokenizer, text: str, tags: Tags) -> list[int]:
    """`text` as tokens with every tag spelled out character by character."""
    pattern = "(" + "|".join(re.escape(t) for t in tags.ids) + ")"
    out = []
    for i, part in enumerate(re.split(pattern, text)):
        pieces = list(part) if i % 2 else [part] if part else []
        out += [t for piece in pieces for t in tokenizer.tokenize_str(piece)]
    return out


FORMS = [*FORMATS, "mistral_args"]


def form(name: str):
    return get_format("mistral", "[ARGS]") if name == "mistral_args" else get_format(name)


def render_form(name: str, calls: list[tuple[str, dict]]) -> str:
    if name == "mistral_args":
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    if name == "llama3_json":  # the tag Llama 3.1 may open its calls with
        return "<|python_tag|>" + render_many(name, calls)
    return render_many(name, calls)


@pytest.mark.parametrize("name", FORMS)
def test_forced_grammar_takes_the_special_tags(tagged, name):
    """The original failure: the tag spelled as a string let the mask offer the special token
    and the matcher refuse it, a one-token reply ending in "error"."""
    tokenizer, tags = tagged
    fmt = form(name)
    lark = call_grammar(fmt, TOOLS, tags=tags)
    for calls in ([("add", SUM)], [("get_weather", WEATHER), ("add", SUM)]):
        text = render_form(name, calls)
        as_model_writes = tokenizer.tokenize_str(text, parse_special=True)
        assert set(as_model_writes) & set(tags.ids.values())
        assert tokens_accepted(tokenizer, lark, as_model_writes), text
        # the same characters as plain text are no call of this vocabulary
        assert not tokens_accepted(tokenizer, lark, spelled(tokenizer, text, tags)), text
        assert calls_of(parse(text, fmt, NAMES, tools=TOOLS)) == calls
    bad = tokenizer.tokenize_str(render_form(name, [("add", {"a": 2})]), parse_special=True)
    assert not tokens_accepted(tokenizer, lark, bad)
    if name == "llama3_json":  # the tag is optional
        assert tokens_accepted(tokenizer, lark, tokenizer.tokenize_str(render(name, "add", SUM)))


@pytest.mark.parametrize("name", FORMS)
def test_auto_grammar_leaves_text_free_and_checks_calls(tagged, name):
    tokenizer, tags = tagged
    fmt = form(name)
    lark = auto_grammar(fmt, TOOLS, tags=tags)
    ids = lambda text: tokenizer.tokenize_str(text, parse_special=True)  # noqa: E731
    eos = [2]
    assert tokens_accepted(tokenizer, lark, ids("No call: x < y, {a} <b> [c]") + eos)
    # Other special tokens (Qwen3's <think>) pass where the trigger is a token; Llama 3's
    # replies are text or JSON, read at the character level.
    others = ids("<|im_start|> other special tokens") + eos
    assert tokens_accepted(tokenizer, lark, others) is (name != "llama3_json")
    call = render_form(name, [("get_weather", WEATHER)])
    lead = "" if name == "llama3_json" else "Let me check.\n"  # llama3: JSON opens the reply
    assert tokens_accepted(tokenizer, lark, ids(lead + call) + eos)
    assert not tokens_accepted(tokenizer, lark, ids(lead + render_form(name, [("add", {"a": 2})])))
    assert not tokens_accepted(tokenizer, lark, ids(lead + render_form(name, [("rm", {})])))
    two = render_form(name, [("add", SUM), ("add", SUM)])
    assert tokens_accepted(tokenizer, lark, ids(lead + two) + eos)
    one_only = auto_grammar(fmt, TOOLS, parallel=False, tags=tags)
    assert not tokens_accepted(tokenizer, one_only, ids(lead + two) + eos)


@pytest.mark.parametrize("name", ["hermes", "qwen3_coder"])
def test_auto_grammar_with_a_text_trigger(tokenizer, name):
    """Where the tag is plain text (no special token), a lazy lexeme ends free text at it."""
    lark = auto_grammar(name, TOOLS)
    ids = tokenizer.tokenize_str
    assert tokens_accepted(tokenizer, lark, ids("Plain words <b>bold</b> and <tool no") + [2])
    assert tokens_accepted(tokenizer, lark, ids("Ok.\n" + render(name, "add", SUM) + " done") + [2])
    assert not tokens_accepted(tokenizer, lark, ids("Ok.\n" + render(name, "add", {"a": "x"})))


def test_kept_special_tags_stay_in_the_text(tmp_path):
    """The engine's detokenizer drops special tokens but the format's tags."""
    from pathlib import Path

    from pagecli.tokenizer import IncrementalDetokenizer, Tokenizer
    from tests.tool_tokenizer import TAGS, tool_model_dir

    template = Path(__file__).parent / "templates" / "hermes.jinja"
    tok = Tokenizer(tool_model_dir(tmp_path / "m", template), "tool-tags")
    text = '[TOOL_CALLS]add[ARGS]{"a": 2, "b": 40}<|im_end|>'
    token_ids = tok.encode(text, 1000, add_special_tokens=False)
    assert TAGS["[TOOL_CALLS]"] in token_ids
    keep = frozenset({TAGS["[TOOL_CALLS]"], TAGS["[ARGS]"]})
    for kept, want in (
        (keep, text[: -len("<|im_end|>")]),
        (frozenset(), 'add{"a": 2, "b": 40}'),
    ):
        detok = IncrementalDetokenizer(tok, True, kept)
        streamed = "".join(detok.add([t]) for t in token_ids)
        assert streamed == detok.text == want
