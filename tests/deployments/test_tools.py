"""Tool calls out of an answer's text (the Hermes format), whole or streamed in any cut, and the checks of
which chat templates can serve tools."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rayapp.deployments.tools import ToolAnswer, forced_output, template_problem

TEMPLATE = (Path(__file__).parent / "templates" / "chatml_tools.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time"}}
ANSWER = (
    'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
)


def _streamed(answer: ToolAnswer, text: str, cuts: list[int]) -> tuple[str, list[dict]]:
    content, deltas, last = [], [], 0
    for cut in [*sorted(set(cuts)), len(text)]:
        piece, more = answer.feed(text[last:cut])
        content.append(piece)
        deltas += more
        last = cut
    piece, more = answer.finish()
    return "".join(content) + piece, deltas + more


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_calls_are_parsed_out_of_the_text_and_the_rest_is_content():
    answer = ToolAnswer("auto")
    content, calls = answer.parse(ANSWER)
    assert content == "Let me look."
    assert _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert answer.finish_reason("stop") == "tool_calls" and answer.finish_reason("length") == "length"
    plain = ToolAnswer("auto")
    assert plain.parse("No tools needed.") == ("No tools needed.", []) and plain.finish_reason("stop") == "stop"
    # Not JSON between the tags: left in the text, as the model wrote it.
    assert ToolAnswer("auto").parse("<tool_call>oops</tool_call>") == ("<tool_call>oops</tool_call>", [])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, len(ANSWER)), max_size=12))
def test_streamed_in_any_cut_gives_the_same_content_and_calls(cuts):
    content, deltas = _streamed(ToolAnswer("auto"), ANSWER, cuts)
    assert content.strip() == "Let me look."
    assert [d["index"] for d in deltas] == [0, 1]
    assert _calls(deltas) == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_text_that_only_looks_like_a_call_start_is_streamed_in_the_end():
    content, deltas = _streamed(ToolAnswer("auto"), "a <tool_c b <tool", [3, 8, 14])
    assert (content, deltas) == ("a <tool_c b <tool", [])


def test_an_answer_that_ends_inside_a_call_still_calls():
    text = '<tool_call>{"name": "get_time", "arguments": {}}'
    assert _calls(ToolAnswer("auto").parse(text)[1]) == [("get_time", {})]
    assert _calls(_streamed(ToolAnswer("auto"), text, [5, 20])[1]) == [("get_time", {})]


def test_a_named_choice_streams_the_arguments_and_required_parses_the_array():
    named = ToolAnswer({"type": "function", "function": {"name": "get_weather"}})
    content, deltas = _streamed(named, '{"city": "Paris"}', [3, 9])
    assert content == "" and deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"]
    assert "".join(d["function"]["arguments"] for d in deltas) == '{"city": "Paris"}'
    assert named.finish_reason("stop") == "stop"  # a call forced by name ends as OpenAI's do
    required = ToolAnswer("required")
    text = '[{"name": "get_time", "parameters": {}}]'
    assert _calls(_streamed(required, text, [4])[1]) == [("get_time", {})]
    assert required.finish_reason("stop") == "tool_calls"


def test_required_calls_cut_off_by_max_tokens_keep_the_complete_ones():
    text = '[{"name": "get_time", "parameters": {}},{"name": "get_weather", "parameters": {"ci'
    assert _calls(ToolAnswer("required").parse(text)[1]) == [("get_time", {})]
    spaced = '[\n {\n  "name": "get_time",\n  "parameters": {}\n }\n]'
    assert _calls(ToolAnswer("required").parse(spaced)[1]) == [("get_time", {})]


def test_without_parallel_calls_only_the_first_is_kept():
    assert _calls(ToolAnswer("auto", parallel=False).parse(ANSWER)[1]) == [("get_weather", {"city": "Paris"})]
    first = [("get_weather", {"city": "Paris"})]
    assert _calls(_streamed(ToolAnswer("auto", parallel=False), ANSWER, [40])[1]) == first
    one = json.loads(forced_output([WEATHER, TIME], "required", parallel=False).json_schema)
    assert one["maxItems"] == 1


def test_forced_choices_constrain_to_the_tools_schemas():
    named = json.loads(
        forced_output([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}).json_schema
    )
    assert named == WEATHER["function"]["parameters"]
    required = json.loads(forced_output([WEATHER, TIME], "required").json_schema)
    assert required["minItems"] == 1
    assert [c["properties"]["name"]["enum"] for c in required["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert forced_output([WEATHER], "auto") is None and forced_output([WEATHER], "none") is None


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        (TEMPLATE, None),
        (None, "no chat template"),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "does not render tools"),
        ("{{ tools | tojson }}{% for m in messages %}{{ m['content'] }}{% endfor %}", "Hermes"),
    ],
)
def test_which_templates_can_serve_tools(template, problem):
    found = template_problem(template)
    assert found is None if problem is None else problem in found


def test_the_shipped_models_template_cannot(tokenizer):
    assert "does not render tools" in template_problem(tokenizer.chat_template)
