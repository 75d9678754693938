"""Structured output and tool calls over HTTP, with the bodies clients send (written out): the openai
client's response_format and tools, langchain-openai's with_structured_output (json_schema and
function_calling) and bind_tools, and a tool's result sent back. Answers validate against their
schemas on the real model; a bad schema or tool_choice is a 400 that names the field."""
import json

import httpx
import jsonschema
import pytest

from helpers.live_server import live_server
from minillm.server.tools import ToolCallStream, parse_calls, split_answer, split_calls

openai = pytest.importorskip("openai")
MODEL = "smol"
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                         "country": {"type": "string", "maxLength": 30}},
        "required": ["city", "country"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


@pytest.fixture(scope="module")
def url(model, tokenizer):
    with live_server(model, tokenizer, MODEL, max_model_len=1024) as s:
        yield s[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def chat(url, body, status=200):
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "temperature": 0, **body}, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def assert_valid_calls(calls, names=PARAMS):
    assert calls
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_") and c["function"]["name"] in names
        jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMS[c["function"]["name"]])


# ------------------------------------------------------------ response_format
def test_json_schema_answer_validates(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a city and its country."}], temperature=0,
        max_tokens=60, response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY,
                                                                                "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)


def test_json_object_and_text(url):
    body = {"messages": [{"role": "user", "content": "Describe a cat."}], "max_tokens": 60}
    obj = chat(url, body | {"response_format": {"type": "json_object"}})["choices"][0]
    assert obj["finish_reason"] == "stop" and isinstance(json.loads(obj["message"]["content"]), dict)
    plain = chat(url, body | {"response_format": {"type": "text"}, "max_tokens": 8})["choices"][0]
    assert plain["message"]["content"] == chat(url, body | {"max_tokens": 8})["choices"][0]["message"]["content"]


def test_completions_take_response_format_too(url):
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "A city as JSON:", "temperature": 0,
                                                  "max_tokens": 60, "response_format": {
                                                      "type": "json_schema", "json_schema": {"name": "c", "schema": CITY}}},
                   timeout=120)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), CITY)


@pytest.mark.parametrize("fmt, message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}, "JSON schema is not valid"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": 3}}},
     "JSON schema is not valid"),
    ({"type": "json_schema"}, "needs 'json_schema'"),
    ({"type": "yaml"}, "response_format.type"),
])
def test_a_bad_response_format_is_a_400_naming_it(url, fmt, message):
    err = chat(url, {"messages": ASK, "response_format": fmt}, 400)["error"]
    assert message in err["message"] and err["param"].startswith("response_format")


def test_a_grammar_and_ignore_eos_are_refused(url):
    err = chat(url, {"messages": ASK, "response_format": {"type": "json_object"}, "ignore_eos": True}, 400)["error"]
    assert "ignore_eos" in err["message"]


# ------------------------------------------------------------ tools
def test_required_tool_calls_validate_and_stream_the_same(client):
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=80)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert_valid_calls([c.model_dump() for c in msg.tool_calls])
    streamed, reasons = {}, []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or ():
            streamed[d.index] = (d.function.name, d.function.arguments)
        reasons.append(chunk.choices[0].finish_reason)
    assert [streamed[i] for i in sorted(streamed)] == [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    assert reasons[-1] == "tool_calls"


def test_calls_cut_short_keep_the_whole_ones_streamed_or_not(client):
    # allowed any number of calls, the small model calls again and again: max_tokens cuts one short
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=60)
    r = client.chat.completions.create(**kw)
    msg, reason = r.choices[0].message, r.choices[0].finish_reason
    assert reason == "length" and msg.tool_calls, (reason, msg)
    assert_valid_calls([c.model_dump() for c in msg.tool_calls])
    assert msg.content is None                            # the unfinished call is dropped, not sent as markup
    calls, content, reasons = [], "", []
    for chunk in client.chat.completions.create(**kw, stream=True):
        d = chunk.choices[0].delta
        calls += [(c.function.name, c.function.arguments) for c in d.tool_calls or ()]
        content += d.content or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert calls == [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    assert content == "" and reasons[-1] == "length"


def test_a_named_function_one_call_and_none(url):
    named = chat(url, {"messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 80, "parallel_tool_calls": False,
                       "tool_choice": {"type": "function", "function": {"name": "get_time"}}})["choices"][0]
    calls = named["message"]["tool_calls"]
    assert len(calls) == 1 and named["finish_reason"] == "tool_calls"
    assert_valid_calls(calls, names={"get_time"})
    none = chat(url, {"messages": ASK, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 8})["choices"][0]
    assert "tool_calls" not in none["message"] and none["message"]["content"]


def test_auto_answers_text_or_calls(url):
    body = {"messages": [{"role": "user", "content": "Say hello."}], "tools": [WEATHER], "max_tokens": 12}
    out = chat(url, body)["choices"][0]
    calls = out["message"].get("tool_calls")
    if calls:
        assert_valid_calls(calls)
    else:
        assert out["message"]["content"] and not out["message"]["content"].startswith("<")


def test_a_tool_result_goes_back_into_the_chat(url):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": json.dumps({"temperature": 18})}]
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": msgs}, timeout=30).json()
    text = httpx.post(f"{url}/detokenize", json={"tokens": r["tokens"]}, timeout=30).json()["prompt"]
    assert '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 18}\n</tool_response><|im_end|>' in text
    out = chat(url, {"messages": msgs, "tools": [WEATHER], "max_tokens": 40})["choices"][0]
    assert out["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("body, param, message", [
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tools", "nope"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "same name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]}, "tools",
     "not valid"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type", "function"),
])
def test_bad_tools_are_a_400_naming_them(url, body, param, message):
    err = chat(url, {"messages": ASK, **body}, 400)["error"]
    assert message in err["message"] and err["param"] == param


# ------------------------------------------------------------ what langchain-openai sends
def test_langchain_with_structured_output_json_schema(url):
    body = {"messages": [{"role": "user", "content": "Name a city and its country."}], "model": MODEL, "stream": False,
            "temperature": 0.0, "max_tokens": 60, "n": 1, "logprobs": None, "top_p": None,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "City", "description": "A city and its country.", "strict": None, "schema": CITY}}}
    out = chat(url, body)["choices"][0]
    jsonschema.validate(json.loads(out["message"]["content"]), CITY)


def test_langchain_function_calling_and_bind_tools(url):
    fn = {"type": "function", "function": {"name": "City", "description": "A city and its country.",
                                           "parameters": CITY}}
    structured = chat(url, {"messages": [{"role": "user", "content": "Name a city and its country."}],
                            "model": MODEL, "stream": False, "temperature": 0.0, "max_tokens": 80,
                            "tools": [fn], "parallel_tool_calls": False,
                            "tool_choice": {"type": "function", "function": {"name": "City"}}})["choices"][0]
    (call,) = structured["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)
    bound = chat(url, {"messages": ASK, "model": MODEL, "stream": False, "temperature": 0.0, "max_tokens": 80,
                       "tools": [WEATHER, TIME], "tool_choice": "required"})["choices"][0]
    assert_valid_calls(bound["message"]["tool_calls"])


# ------------------------------------------------------------ the parser, piece by piece
def test_tool_call_stream_gives_the_whole_answers_calls_in_any_pieces():
    text = ('<tool_call>\n{"name":"get_time","arguments":{"city":"Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome","unit":"celsius"}}\n</tool_call>')
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in parse_calls(text)]
    for step in (1, 3, 7, len(text)):
        s, got = ToolCallStream(), []
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        for j, p in enumerate(pieces):
            for d in s.push(p, j == len(pieces) - 1):
                assert "content" not in d
                got += [(c["function"]["name"], c["function"]["arguments"]) for c in d["tool_calls"]]
        assert got == whole and s.called
    cut = ToolCallStream()
    assert cut.push(text[:30], False) == [] and cut.push(text[30:40], True) == []     # cut short: dropped
    calls, tail = split_calls(text + "\n<tool_call>\n{\"na")
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"] and tail == "\n<tool_call>\n{\"na"
    names = lambda answer: ([c["function"]["name"] for c in answer[0]], answer[1])     # noqa: E731 (ids are new)
    assert names(split_answer(text + "\n<tool_call>\n{\"na")) == (["get_time", "get_weather"], None)
    assert split_answer(text[:40]) == ([], None)
    assert split_answer("<tool") == ([], None) and split_answer("Hello") == ([], "Hello")
    after = ToolCallStream()
    assert [list(d) for d in after.push(text + "\n<tool_call>\n{", True)] == [["tool_calls"], ["tool_calls"]]
    plain = ToolCallStream()
    assert plain.push("Hi", False) == [{"content": "Hi"}] and parse_calls("Hi") is None
