"""The tool-call parsers, on the model outputs vLLM's own tests use (each literal names its file in
vllm-project/vllm), plus the malformed cases a rollout has to survive.
"""

import json
import re

import pytest

from stages.generation import tool_parsers
from stages.generation.tool_parsers import PARSERS, Parsed, detect, parse


def calls(parsed: Parsed) -> list[tuple[str, dict]]:
    """(name, decoded arguments) of each call, after checking the OpenAI shape and the ids."""
    out = []
    for i, call in enumerate(parsed.tool_calls):
        assert set(call) == {"id", "type", "function"}
        assert call["id"] == f"call_{i}" and call["type"] == "function"
        assert set(call["function"]) == {"name", "arguments"}
        assert isinstance(call["function"]["arguments"], str)
        out.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
    return out


def test_registry_and_parse():
    assert list(PARSERS) == ["hermes", "llama3_json", "mistral"]
    assert parse("hermes", "hi") == Parsed("hi", [], [])
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        parse("qwen", "hi")


# --- hermes ---------------------------------------------------------------------------------

# tests/tool_parsers/test_hermes_tool_parser.py (test_hermes_parser_non_streaming_tool_call_between_tags)
HERMES_BETWEEN_TAGS = """<tool_call>
{"name": "final_answer", "arguments": {"trigger": true}}
</tool_call>"""
# tests/tool_parsers/test_hermes_tool_parser.py (test_hermes_parser_non_streaming_tool_call_until_eos)
HERMES_UNTIL_EOS = """<tool_call>
{"name": "final_answer", "arguments": {"trigger": true}}"""
# tests/tool_parsers/test_hermes_tool_parser.py (test_hermes_parser_non_streaming_tool_call_invalid_json)
HERMES_INVALID_JSON = """<tool_call>
{"name": "final_answer", "arguments": {"trigger": true}"""
# tests/tool_parsers/test_hermes_tool_parser.py (..._content_then_tool_call_with_stream_interval)
HERMES_CONTENT_THEN_CALL = ('Sure, let me check the weather.<tool_call>{"name": "get_weather", '
                            '"arguments": {"city": "NYC"}}</tool_call>')
# tests/tool_parsers/test_hermes_tool_parser.py (..._multiple_tool_calls_with_stream_interval)
HERMES_TWO_CALLS = ('<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>'
                    '<tool_call>{"name": "search", "arguments": {"q": "dogs"}}</tool_call>')
# tests/tool_parsers/test_hermes_tool_parser.py (test_hermes_parser_non_streaming_serialized_arguments)
HERMES_SERIALIZED_ARGS = ('<tool_call>\n{"name": "get_db_config", '
                          '"arguments": "{\\"param\\": \\"max_connections\\"}"}\n</tool_call>')
# tests/tool_parsers/test_hermes_tool_parser.py (test_hermes_parser_non_streaming_bare_string_arguments)
HERMES_BARE_STRING_ARGS = '<tool_call>\n{"name": "do_thing", "arguments": "hello"}\n</tool_call>'
# tests/tool_parsers/test_hermes_tool_parser.py (test_hermes_parser_non_streaming_no_tool_call)
HERMES_NO_CALL = "This is not a tool call."


def test_hermes_single_call():
    parsed = parse("hermes", HERMES_BETWEEN_TAGS)
    assert calls(parsed) == [("final_answer", {"trigger": True})]
    assert parsed.tool_calls[0]["function"]["arguments"] == '{"trigger": true}'  # as vLLM's
    assert parsed.content is None and parsed.errors == []


def test_hermes_unclosed_call_until_eos():
    assert calls(parse("hermes", HERMES_UNTIL_EOS)) == [("final_answer", {"trigger": True})]
    # the end-of-turn token, when decoding kept special tokens, is not part of the JSON
    assert calls(parse("hermes", HERMES_UNTIL_EOS + "<|im_end|>")) == [("final_answer", {"trigger": True})]


def test_hermes_content_before_call():
    parsed = parse("hermes", HERMES_CONTENT_THEN_CALL)
    assert parsed.content == "Sure, let me check the weather."
    assert calls(parsed) == [("get_weather", {"city": "NYC"})]


def test_hermes_several_calls():
    parsed = parse("hermes", HERMES_TWO_CALLS)
    assert calls(parsed) == [("search", {"q": "cats"}), ("search", {"q": "dogs"})]
    assert [c["id"] for c in parsed.tool_calls] == ["call_0", "call_1"]
    assert parsed.content is None


def test_hermes_no_call():
    assert parse("hermes", HERMES_NO_CALL) == Parsed("This is not a tool call.", [], [])


def test_hermes_invalid_json_is_an_error_not_a_crash():
    parsed = parse("hermes", HERMES_INVALID_JSON)
    assert parsed.tool_calls == []
    assert len(parsed.errors) == 1
    assert parsed.errors[0].startswith("tool call 0: not valid JSON")
    assert '"final_answer"' in parsed.errors[0]  # shows the model what it wrote


def test_hermes_arguments_as_json_string_or_object():
    assert calls(parse("hermes", HERMES_SERIALIZED_ARGS)) == [("get_db_config", {"param": "max_connections"})]
    as_object = '<tool_call>\n{"name": "get_db_config", "arguments": {"param": "max_connections"}}\n</tool_call>'
    assert parse("hermes", as_object).tool_calls == parse("hermes", HERMES_SERIALIZED_ARGS).tool_calls
    # vLLM passes a string that holds no object on as the JSON string "hello"; we report it
    parsed = parse("hermes", HERMES_BARE_STRING_ARGS)
    assert parsed.tool_calls == [] and '"arguments" is a string that is not JSON' in parsed.errors[0]


def test_hermes_bad_call_among_good_ones():
    text = ("Let me look.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n"
            "<tool_call>\n{\"arguments\": {\"x\": 2}}\n</tool_call>\n"
            "<tool_call>\n{\"name\": \"c\", \"arguments\": [1, 2]}\n</tool_call>\n"
            "<tool_call>\n{\"name\": \"d\"}\n</tool_call>")
    parsed = parse("hermes", text)
    assert parsed.content == "Let me look."
    assert calls(parsed) == [("a", {"x": 1}), ("d", {})]  # no arguments key: {}
    assert [e.split(":")[0] for e in parsed.errors] == ["tool call 1", "tool call 2"]
    assert 'missing "name"' in parsed.errors[0]
    assert '"arguments" must be a JSON object, got a list' in parsed.errors[1]


def test_hermes_unicode_arguments_kept():
    parsed = parse("hermes", '<tool_call>{"name": "say", "arguments": {"text": "café ☕"}}</tool_call>')
    assert parsed.tool_calls[0]["function"]["arguments"] == '{"text": "café ☕"}'


# --- llama3_json ----------------------------------------------------------------------------

# tests/tool_parsers/test_llama3_json_tool_parser.py (test_extract_tool_calls_simple)
LLAMA_SIMPLE = ('Here is the result: {"name": "getOpenIncidentsTool", '
                '"parameters": {}} Would you like to know more?')
# tests/tool_parsers/test_llama3_json_tool_parser.py (test_extract_tool_calls_with_arguments)
LLAMA_WITH_ARGS = '{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}'
# tests/tool_parsers/test_llama3_json_tool_parser.py (test_extract_tool_calls_no_json)
LLAMA_NO_JSON = "This is just some text without any tool calls"
# tests/tool_parsers/test_llama3_json_tool_parser.py (test_extract_tool_calls_invalid_json)
LLAMA_INVALID_JSON = '{"name": "invalidTool", "parameters": {invalid json}'
# tests/tool_parsers/test_llama3_json_tool_parser.py (test_extract_tool_calls_with_arguments_key)
LLAMA_ARGUMENTS_KEY = '{"name": "searchTool", "arguments": {"query": "test"}}'
# tests/tool_parsers/test_llama3_json_tool_parser.py (test_extract_tool_calls_multiple_json)
LLAMA_MULTIPLE = ('{"name": "searchTool", "parameters": {"query": "test1"}}; '
                  '{"name": "getOpenIncidentsTool", "parameters": {}}; '
                  '{"name": "searchTool", "parameters": {"query": "test2"}}')
# tests/tool_parsers/test_llama3_json_tool_parser.py (test_extract_tool_calls_multiple_json_with_whitespace)
LLAMA_MULTIPLE_SPACED = ('{"name": "searchTool", "parameters": {"query": "test1"}} ; '
                         '{"name": "getOpenIncidentsTool", "parameters": {}} ; '
                         '{"name": "searchTool", "parameters": {"query": "test2"}}')
# tests/tool_parsers/test_llama3_json_tool_parser.py (test_extract_tool_calls_with_quotes_and_brackets_in_string)
LLAMA_BRACKETS_IN_STRINGS = ('{"name": "searchTool", "parameters": {"query": "test {value} [complex]",'
                             '"nested": {"inner": "more {brackets}"}}}')
# tests/tool_parsers/test_llama3_json_tool_parser.py (test_extract_tool_calls_missing_name_key)
LLAMA_MISSING_NAME = '{"parameters": {}}'
# tests/tool_parsers/test_llama3_json_tool_parser.py (test_extract_tool_calls_brace_in_trailing_text)
LLAMA_BRACE_IN_PROSE = '{"name": "searchTool", "parameters": {"query": "test"}} I used {searchTool} for this.'
# tests/tool_parsers/test_llama3_json_tool_parser.py (test_extract_tool_calls_json_fragment_in_trailing_text)
LLAMA_JSON_IN_PROSE = ('{"name": "searchTool", "parameters": {"query": "test"}} '
                       'The arguments I passed were {"query": "test"}')


def test_llama_single_call():
    parsed = parse("llama3_json", LLAMA_WITH_ARGS)
    assert calls(parsed) == [("searchTool", {"query": "test query", "limit": 10})]
    assert parsed.content is None and parsed.errors == []


def test_llama_python_tag_and_content_around():
    parsed = parse("llama3_json", "<|python_tag|>" + LLAMA_WITH_ARGS + "<|eom_id|>")
    assert calls(parsed) == [("searchTool", {"query": "test query", "limit": 10})]
    assert parsed.content is None
    parsed = parse("llama3_json", LLAMA_SIMPLE)
    assert calls(parsed) == [("getOpenIncidentsTool", {})]
    assert parsed.tool_calls[0]["function"]["arguments"] == "{}"
    assert parsed.content == "Here is the result: Would you like to know more?"  # vLLM: None


@pytest.mark.parametrize("text", [LLAMA_MULTIPLE, LLAMA_MULTIPLE_SPACED,
                                  "<|python_tag|>" + LLAMA_MULTIPLE.replace("; ", ";")])
def test_llama_several_calls(text):
    parsed = parse("llama3_json", text)
    assert calls(parsed) == [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}),
                             ("searchTool", {"query": "test2"})]
    assert parsed.content is None and parsed.errors == []


def test_llama_no_call():
    assert parse("llama3_json", LLAMA_NO_JSON) == Parsed(LLAMA_NO_JSON, [], [])


def test_llama_arguments_key_and_string_arguments():
    assert calls(parse("llama3_json", LLAMA_ARGUMENTS_KEY)) == [("searchTool", {"query": "test"})]
    as_string = '{"name": "searchTool", "parameters": "{\\"query\\": \\"test\\"}"}'
    assert parse("llama3_json", as_string).tool_calls == parse("llama3_json", LLAMA_ARGUMENTS_KEY).tool_calls


def test_llama_braces_inside_strings_and_prose():
    args = dict(calls(parse("llama3_json", LLAMA_BRACKETS_IN_STRINGS)))["searchTool"]
    assert args == {"query": "test {value} [complex]", "nested": {"inner": "more {brackets}"}}
    for text in (LLAMA_BRACE_IN_PROSE, LLAMA_JSON_IN_PROSE):
        parsed = parse("llama3_json", text)
        assert calls(parsed) == [("searchTool", {"query": "test"})] and parsed.errors == []
    assert parse("llama3_json", LLAMA_BRACE_IN_PROSE).content == "I used {searchTool} for this."


def test_llama_malformed_calls_are_errors():
    parsed = parse("llama3_json", LLAMA_INVALID_JSON)
    assert parsed.tool_calls == [] and len(parsed.errors) == 1
    assert parsed.errors[0].startswith("tool call 0: not valid JSON") and "invalidTool" in parsed.errors[0]
    parsed = parse("llama3_json", LLAMA_MISSING_NAME)
    assert parsed.tool_calls == [] and 'missing "name"' in parsed.errors[0]
    # a bad call between good ones: the others still count, in order
    parsed = parse("llama3_json", '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {x}}; '
                                  '{"name": "c", "parameters": {}}')
    assert calls(parsed) == [("a", {"x": 1}), ("c", {})]
    assert len(parsed.errors) == 1 and parsed.errors[0].startswith("tool call 1:")
    assert parsed.content is None
    # a python tag with no JSON after it (Llama's built-in tools) is an error too
    parsed = parse("llama3_json", '<|python_tag|>brave_search.call(query="weather")')
    assert parsed.tool_calls == [] and "<|python_tag|>" in parsed.errors[0]


# --- mistral --------------------------------------------------------------------------------

# tests/tool_parsers/test_mistral_tool_parser.py (test_extract_tool_calls_pre_v11_tokenizer: single_tool_add)
MISTRAL_ADD = """[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]"""
# tests/tool_parsers/test_mistral_tool_parser.py (test_extract_tool_calls_pre_v11_tokenizer: single_tool_weather)
MISTRAL_WEATHER = ("""[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "San Francisco", """
                   """"state": "CA", "unit": "celsius"}}]""")
# tests/tool_parsers/test_mistral_tool_parser.py (..._pre_v11_tokenizer: argument_before_name_and_name_in_argument)
MISTRAL_NAME_IN_ARGUMENT = """[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]"""
# tests/tool_parsers/test_mistral_tool_parser.py (test_extract_tool_calls_pre_v11_tokenizer: multiple_tools)
MISTRAL_MULTIPLE = ("""[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "get_current_weather", """
                    """"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}}]""")
# tests/tool_parsers/test_mistral_tool_parser.py (test_extract_tool_calls_pre_v11_tokenizer: content_before_tool)
MISTRAL_CONTENT_BEFORE = """Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]"""
# tests/tool_parsers/test_mistral_tool_parser.py (test_extract_tool_calls_pre_v11_tokenizer: trailing_data_after_json)
MISTRAL_TRAILING = ("""[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "Dallas", "state": "TX", """
                    """"unit": "fahrenheit"}}]\nextra trailing data""")
# tests/tool_parsers/test_mistral_tool_parser.py (test_extract_tool_calls_pre_v11_regex_fallback_fails)
MISTRAL_NOT_JSON = "[TOOL_CALLS] not json at all"
# tests/tool_parsers/test_mistral_tool_parser.py (test_extract_tool_calls_no_tools)
MISTRAL_NO_TOOLS = "This is a test"
# tests/tool_parsers/test_mistral_tool_parser.py (test_extract_tool_calls: multiple_tool_calls, v11 format)
MISTRAL_V11_MULTIPLE = """[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}"""
# tests/tool_parsers/test_mistral_tool_parser.py (test_extract_tool_calls: wrong_json, v11 format)
MISTRAL_V11_CONTENT = """hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')"}"""
# tests/tool_parsers/test_mistral_tool_parser.py (test_extract_tool_calls: complex, v11 format; unclosed JSON)
MISTRAL_V11_UNCLOSED = """hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r\'{}\')\""""


def test_mistral_single_call():
    parsed = parse("mistral", MISTRAL_ADD)
    assert calls(parsed) == [("add", {"a": 3.5, "b": 4})]
    assert parsed.tool_calls[0]["function"]["arguments"] == json.dumps({"a": 3.5, "b": 4})  # as vLLM's
    assert parsed.content is None and parsed.errors == []
    assert calls(parse("mistral", MISTRAL_WEATHER)) == [
        ("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"})]
    assert calls(parse("mistral", MISTRAL_NAME_IN_ARGUMENT)) == [("get_age", {"name": "John Doe"})]
    assert calls(parse("mistral", MISTRAL_TRAILING)) == [
        ("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"})]


def test_mistral_several_calls():
    assert calls(parse("mistral", MISTRAL_MULTIPLE)) == [
        ("add", {"a": 3.5, "b": 4}),
        ("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"})]
    parsed = parse("mistral", MISTRAL_V11_MULTIPLE + "</s>")
    assert calls(parsed) == [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3, "b": 6})]
    assert [c["id"] for c in parsed.tool_calls] == ["call_0", "call_1"]


def test_mistral_content_before_calls():
    parsed = parse("mistral", MISTRAL_CONTENT_BEFORE)
    assert parsed.content == "Hello" and calls(parsed) == [("add", {"a": 1, "b": 2})]
    parsed = parse("mistral", MISTRAL_V11_CONTENT)
    assert parsed.content == "hi{hi"
    assert calls(parsed) == [("bash", {"command": "print(\"hello world!\")\nre.compile(r'{}')"})]
    parsed = parse("mistral", '[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}')  # an HF tokenizer's [ARGS]
    assert calls(parsed) == [("get_time", {"tz": "UTC"})]


def test_mistral_no_call():
    assert parse("mistral", MISTRAL_NO_TOOLS) == Parsed("This is a test", [], [])


def test_mistral_malformed_calls_are_errors():
    for text in (MISTRAL_NOT_JSON, MISTRAL_V11_UNCLOSED, "[TOOL_CALLS]", "[TOOL_CALLS]toolname_no_args",
                 '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}'):
        parsed = parse("mistral", text)
        assert parsed.tool_calls == [] and len(parsed.errors) == 1, text
    assert "arguments are not valid JSON" in parse("mistral", MISTRAL_V11_UNCLOSED).errors[0]
    parsed = parse("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": "{\\"a\\": 1}"}, {"arguments": {}}, 7]')
    assert calls(parsed) == [("add", {"a": 1})]
    assert [e.split(":")[0] for e in parsed.errors] == ["tool call 1", "tool call 2"]
    assert "got a number" in parsed.errors[1]


# --- vLLM's other cases, and where we part from them ---------------------------------------

# (parser, model output, vLLM's test, the calls vLLM returns): the calls are the same here
VLLM_SAME_CALLS = [
    ("llama3_json", 'Here are the results: {"name": "searchTool", "parameters": {"query": "test1"}}; '
     '{"name": "getOpenIncidentsTool", "parameters": {}}; {"name": "searchTool", "parameters": '
     '{"query": "test2"}} Would you like to know more?',
     "test_extract_tool_calls_multiple_json_with_surrounding_text",
     [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}), ("searchTool", {"query": "test2"})]),
    ("llama3_json", '{"name": "complexTool", "parameters": {"level1": {"level2": {"level3": {"level4": '
     '{"value": "deep"}}}}}}', "test_extract_tool_calls_deeply_nested_json",
     [("complexTool", {"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}})]),
    ("llama3_json", '{"name": "simpleTool", "parameters": {"value": "test"}}; {"name": "complexTool", '
     '"parameters": {"config": {"database": {"connection": {"pool": {"size": 10}}}}}}',
     "test_extract_tool_calls_multiple_with_deep_nesting",
     [("simpleTool", {"value": "test"}),
      ("complexTool", {"config": {"database": {"connection": {"pool": {"size": 10}}}}})]),
    ("llama3_json", '{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}',
     "test_extract_tool_calls_with_escaped_quotes_in_nested_json",
     [("parserTool", {"text": 'He said "Hello {world}"'})]),
    *[("llama3_json", '{"name": "searchTool", "parameters": {"query": "test1"}}' + separator
       + '{"name": "getOpenIncidentsTool", "parameters": {}}',
       "test_extract_tool_calls_streaming_parallel_separators",
       [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {})])
      for separator in ("; ", ";", ";\n", "\n")],
    ("mistral", '[TOOL_CALLS] [{"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}, '
     '"name": "get_current_weather"}]', "test_extract_tool_calls_pre_v11_tokenizer (argument_before_name)",
     [("get_current_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"})]),
    ("mistral", '[TOOL_CALLS]  junk [{"name": "add", "arguments":{"a": 1, "b": 2}}] trail',
     "test_extract_tool_calls_pre_v11_regex_fallback", [("add", {"a": 1, "b": 2})]),
    ("mistral", '[TOOL_CALLS]  [ {"name":"add" , "arguments" : {"a": 3, "b": 4} } ]',
     "test_extract_tool_calls_streaming_one_chunk (pre_v11-single_tool_add)", [("add", {"a": 3, "b": 4})]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments":{"a": "3", "b": "4"}}]',
     "test_extract_tool_calls_streaming_one_chunk (pre_v11-single_tool_add_strings)",
     [("add", {"a": "3", "b": "4"})]),
    ("mistral", '[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}',
     "test_extract_tool_calls (single_tool_add)", [("add_this_and_that", {"a": 3.5, "b": 4})]),
    ("mistral", 'bla[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}',
     "test_extract_tool_calls_streaming_one_chunk (v11-content_before_tool)",
     [("add_this_and_that", {"a": 3.5, "b": 4})]),
]


@pytest.mark.parametrize("parser, text, vllm_test, expected", VLLM_SAME_CALLS,
                         ids=[case[2] for case in VLLM_SAME_CALLS])
def test_vllm_cases_give_vllm_s_calls(parser, text, vllm_test, expected):
    parsed = parse(parser, text)
    assert calls(parsed) == expected and parsed.errors == []
    for call, (_, arguments) in zip(parsed.tool_calls, expected):
        assert call["function"]["arguments"] == json.dumps(arguments)  # as vLLM serialises them


# Where offseason parts from vLLM on purpose, numbered as tool_parsers' docstring numbers them:
# (number, parser, model output, vLLM's test, what vLLM returns, what offseason returns)
DIFFERENCES = [
    (1, "hermes", HERMES_INVALID_JSON, "test_hermes_parser_non_streaming_tool_call_invalid_json",
     "no call; the text as content", "an error"),
    (1, "llama3_json", LLAMA_INVALID_JSON, "test_extract_tool_calls_invalid_json",
     "no call; the text as content", "an error"),
    (2, "llama3_json", LLAMA_MISSING_NAME, "test_extract_tool_calls_missing_name_key",
     "no call; the text as content", "an error"),
    (3, "llama3_json", '{"name": "toolWithoutParams"}',
     "test_extract_tool_calls_missing_parameters_and_arguments_key",
     "no call; the text as content", [("toolWithoutParams", {})]),
    (4, "hermes", HERMES_BARE_STRING_ARGS, "test_hermes_parser_non_streaming_bare_string_arguments",
     'a call with the arguments "hello"', "an error"),
    (5, "llama3_json", LLAMA_SIMPLE, "test_extract_tool_calls_simple", "content None",
     "Here is the result: Would you like to know more?"),
    (6, "mistral", MISTRAL_NOT_JSON, "test_extract_tool_calls_pre_v11_regex_fallback_fails",
     'no call; content "not json at all"', "an error"),
    (7, "mistral", MISTRAL_V11_UNCLOSED, "test_extract_tool_calls",
     "a call whose arguments are cut off (not JSON)", "an error"),
    (8, "mistral", "[TOOL_CALLS]toolname_no_args", "test_extract_tool_calls_v11_without_args_skipped",
     "no call, no content", "an error"),
    (9, "mistral", '[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1}}][TOOL_CALLS] [{"name": "sub", '
     '"arguments":{"b": 2}}]', "test_extract_tool_calls_pre_v11_multiple_bot_tokens_raises",
     "ValueError", [("add", {"a": 1}), ("sub", {"b": 2})]),
]


@pytest.mark.parametrize("number, parser, text, vllm_test, vllm, ours", DIFFERENCES,
                         ids=[f"{case[0]}-{case[3]}" for case in DIFFERENCES])
def test_each_difference_from_vllm_is_what_the_docstring_and_readme_say(number, parser, text,
                                                                       vllm_test, vllm, ours):
    from pathlib import Path

    parsed = parse(parser, text)
    if ours == "an error":
        assert parsed.tool_calls == [] and len(parsed.errors) == 1
    elif isinstance(ours, list):
        assert calls(parsed) == ours and parsed.errors == []
    else:
        assert parsed.content == ours
    readme = (Path(__file__).resolve().parents[3] / "docs" / "agent.md").read_text()
    for where in (tool_parsers.__doc__, readme):  # stated, with the vLLM test it departs from
        listed = re.split(r"Each difference,\s+with the vLLM test it departs from:", where)[1]
        stated = re.split(rf"\n{number + 1}\. |\n\n", listed.split(f"\n{number}. ", 1)[1])[0]
        assert vllm_test in stated, (number, vllm_test)
    assert "10. Calls are numbered `call_0`" in tool_parsers.__doc__


# --- detect ---------------------------------------------------------------------------------

# examples/tool_chat_template_mistral.jinja in vLLM, whole
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% set user_messages = messages | selectattr('role', 'equalto', 'user') | list %}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{% if message == user_messages[-1] %}"
    "{% if tools %}{{ '[AVAILABLE_TOOLS]'+ tools|string + '[/AVAILABLE_TOOLS]' }}{% endif %}"
    "{{ '[INST]' + message['content'] + '[/INST]' }}{% else %}{{ '[INST]' + message['content'] + '[/INST]' }}"
    "{% endif %}{% elif message['role'] == 'assistant' and message['tool_calls'] and message['tool_calls']|length > 0 %}"
    "{{ '[TOOL_CALLS]' + message['content']|string + eos_token }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] + ' ' + eos_token }}{% elif message['role'] == 'tool' %}"
    "{{ '[TOOL_RESULTS]' + message['content']|string + '[/TOOL_RESULTS]' }}{% endif %}{% endfor %}")

# examples/tool_chat_template_llama3.1_json.jinja in vLLM, the lines about tools
LLAMA_TEMPLATE = """{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. ' }}
            {{- '{"name": "' + tool_call.name|trim + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
"""


def test_detect_the_three_families():
    from chat_model import LLAMA31_TEMPLATE, QWEN25_TEMPLATE  # the real families' templates

    assert detect(QWEN25_TEMPLATE) == "hermes"
    assert detect(LLAMA_TEMPLATE) == "llama3_json"
    assert detect(LLAMA31_TEMPLATE) == "llama3_json"
    assert detect("{{ '<|python_tag|>' + message.content }}") == "llama3_json"
    assert detect(MISTRAL_TEMPLATE) == "mistral"


def test_detect_says_what_to_set():
    chatml = "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
    for template in (chatml, ""):
        with pytest.raises(ValueError, match="rollout.tool_parser.*hermes, llama3_json, mistral"):
            detect(template)


def test_parser_functions_are_the_registry():
    assert PARSERS["hermes"] is tool_parsers.hermes
    assert PARSERS["llama3_json"] is tool_parsers.llama3_json
    assert PARSERS["mistral"] is tool_parsers.mistral
