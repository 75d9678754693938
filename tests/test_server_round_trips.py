"""What the SDKs' own helpers send, sent back to a live loopback server: an assistant message as
`model_dump()` returns it, OpenAI's nullable request fields, echo + logprobs for every choice of n,
strict logit_bias keys and seeds, tool parameters with $defs, nested objects in tool arguments, and a
client that hangs up in the middle of its body."""
import json
import logging
import socket
import time

import httpx
import pytest
import torch

from helpers.live_server import live_server

openai = pytest.importorskip("openai")
MODEL = "smol"


@pytest.fixture(scope="module")
def url(model, tokenizer):
    with live_server(model, tokenizer, MODEL, max_model_len=512) as s:
        yield s[0]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def post(url, path, body):
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def test_the_usual_loop_sends_the_answer_back_as_model_dump_gives_it(client):
    messages = [{"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(dumped)      # nulls the server must take
    messages += [dumped, {"role": "user", "content": "And another?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    assert second.choices[0].message.content


def test_openais_nullable_fields_null_or_honourable_mean_the_default(url):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6, "seed": 3}
    plain = post(url, "/v1/chat/completions", chat).json()["choices"][0]["message"]
    for extra in [{k: None for k in ("store", "metadata", "service_tier", "reasoning_effort", "modalities",
                                     "audio", "prediction", "web_search_options", "functions", "function_call",
                                     "verbosity", "prompt_cache_key", "safety_identifier")},
                  {"store": False, "service_tier": "auto", "reasoning_effort": "none", "modalities": ["text"],
                   "prompt_cache_key": "user-7"}]:
        r = post(url, "/v1/chat/completions", chat | extra)
        assert r.status_code == 200 and r.json()["choices"][0]["message"] == plain, (extra, r.text)
    text = {"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0}
    plain = post(url, "/v1/completions", text).json()["choices"][0]["text"]
    for extra in [{"best_of": None, "suffix": None, "store": None, "metadata": None}, {"best_of": 1, "suffix": ""}]:
        r = post(url, "/v1/completions", text | extra)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == plain, (extra, r.text)


@pytest.mark.parametrize("path, extra, param", [
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"metadata": {"user": "7"}}, "metadata"),
    ("/v1/chat/completions", {"service_tier": "flex"}, "service_tier"),
    ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": "", "audio": {"id": "a1"}}]},
     "messages.1.audio"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": None,
                                            "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages.1.function_call"),
    ("/v1/chat/completions", {"bogus": None}, "bogus"),                          # unknown: still refused
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"suffix": " and so on."}, "suffix"),
])
def test_a_value_the_server_cannot_honour_is_a_400_naming_it(url, path, extra, param):
    base = {"model": MODEL, "max_tokens": 4} | ({"prompt": "hi"} if path == "/v1/completions" else
                                                 {"messages": [{"role": "user", "content": "hi"}]})
    r = post(url, path, base | extra)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert len(r.json()["error"]["message"]) < 200


@pytest.mark.parametrize("key", [" 7", "٣", "1_0", "+7", "7.0", ""])
def test_logit_bias_keys_are_plain_decimal_ids(url, key):
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "logit_bias": {key: 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


@pytest.mark.parametrize("seed", [2**64, -2**63 - 1])
def test_a_seed_out_of_range_is_a_400_naming_it(url, seed):
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "seed": seed})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    assert "2**64" in r.json()["error"]["message"] and "Overflow" not in r.json()["error"]["message"]


def test_the_largest_seed_with_n_samples(url):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "n": 3, "seed": 2**64 - 2}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3, r.text
    assert r.json()["choices"] == post(url, "/v1/completions", body).json()["choices"]


def model_logprobs(model, ids) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, from the model's float32 logits."""
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)      # (T, vocab)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def test_echo_and_logprobs_are_each_choices_own(url, model, tokenizer):
    body = {"model": MODEL, "prompt": "The cat sat on the", "max_tokens": 2, "echo": True, "logprobs": 1, "n": 3,
            "temperature": 1, "seed": 1}
    whole = post(url, "/v1/completions", body).json()["choices"]
    streamed = {}
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            for c in json.loads(line[6:])["choices"] if line.startswith("data: {") else ():
                s = streamed.setdefault(c["index"], {"text": "", "tokens": [], "token_logprobs": []})
                s["text"] += c["text"]
                s["tokens"] += c["logprobs"]["tokens"]
                s["token_logprobs"] += c["logprobs"]["token_logprobs"]
    assert len({c["text"] for c in whole}) > 1                     # the samples differ: each must be its own
    prompt = tokenizer.encode(body["prompt"])
    for c in whole:
        lp = c["logprobs"]
        assert "".join(lp["tokens"]) == c["text"] and c["text"].startswith(body["prompt"])
        assert streamed[c["index"]] == {"text": c["text"], "tokens": lp["tokens"], "token_logprobs": lp["token_logprobs"]}
        ids = prompt + [tokenizer.encode(t)[0] for t in lp["tokens"][len(prompt):]]
        assert tokenizer.decode(ids) == c["text"]
        assert lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:] == pytest.approx(model_logprobs(model, ids), abs=2e-3)


def test_pydantic_function_tool_with_defs_and_parse(client):
    """openai's own helpers: pydantic_function_tool writes the enum as a $defs entry (a strict tool), and
    parse() reads the call back into the pydantic model."""
    from enum import Enum

    from pydantic import BaseModel

    class Unit(str, Enum):
        c = "c"
        f = "f"

    class GetWeather(BaseModel):
        city: str
        unit: Unit

    tool = openai.pydantic_function_tool(GetWeather)
    assert "$defs" in tool["function"]["parameters"] and tool["function"]["strict"]
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris, in c?"}],
                                      tools=[tool], tool_choice="required", max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    args = choice.message.tool_calls[0].function.parsed_arguments
    assert isinstance(args, GetWeather) and args.unit in (Unit.c, Unit.f)


def test_nested_objects_in_tool_arguments_take_only_their_listed_properties(url):
    """LangChain's bind_tools with a pydantic sub-model: the nested object does not set additionalProperties."""
    jsonschema = pytest.importorskip("jsonschema")
    params = {"type": "object", "required": ["place"], "properties": {
        "place": {"type": "object", "required": ["city", "country"],
                  "properties": {"city": {"type": "string", "maxLength": 20},
                                 "country": {"type": "string", "maxLength": 20}}}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Book a hotel in Lyon, France."}],
            "tools": [{"type": "function", "function": {"name": "book", "parameters": params}}],
            "tool_choice": "required", "max_tokens": 80, "temperature": 0}
    choice = post(url, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"], choice
    args = json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"])
    closed = json.loads(json.dumps(params).replace('"required"', '"additionalProperties": false, "required"'))
    jsonschema.validate(args, closed)                  # no key beyond those listed, at either depth


LOOP = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
ENDLESS = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                              "required": ["next"]}}, "$ref": "#/$defs/node"}


@pytest.mark.parametrize("schema", [LOOP, ENDLESS], ids=["a-b-a", "endless"])
@pytest.mark.parametrize("where", ["response_format", "tools"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_nothing_satisfies_is_refused_before_generation(url, schema, where, stream):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": stream}
    if where == "tools":
        body |= {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
                 "tool_choice": "required"}
    else:
        body |= {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == where, r.text
    assert "cannot be satisfied" in r.json()["error"]["message"] and len(r.json()["error"]["message"]) < 300


def test_the_tools_grammar_refuses_a_key_not_listed_at_any_depth(tokenizer):
    from minillm.server.tools import tools_grammar
    from minillm.structured import Constraint

    params = {"type": "object", "required": ["place"], "properties": {"place": {"$ref": "#/$defs/Place"}},
              "$defs": {"Place": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
    grammar = tools_grammar([{"name": "book", "parameters": params}], "required", parallel=False)

    def accepted(arguments):
        c = Constraint(grammar, tokenizer)
        text = '<tool_call>\n{"name":"book","arguments":' + arguments + '}\n</tool_call>'
        return all(c.accept(t) for t in tokenizer.encode(text)) and c.done

    assert accepted('{"place":{"city":"Lyon"}}')
    assert not accepted('{"place":{"city":"Lyon","stars":5}}')       # nested, inside a $defs entry
    assert not accepted('{"place":{"city":"Lyon"},"nights":2}')      # top level


def test_a_client_that_hangs_up_mid_body_leaves_no_traceback(url):
    records = []
    keep = logging.Handler()
    keep.emit = records.append
    log = logging.getLogger("uvicorn.error")
    log.addHandler(keep)
    try:
        port = int(url.rsplit(":", 1)[1])
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 1000\r\n\r\n{\"model\": \"smol\", ")
                time.sleep(0.2)
        time.sleep(0.5)
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        log.removeHandler(keep)
    assert not [r for r in records if r.levelno >= logging.ERROR or r.exc_info], [r.getMessage() for r in records]


@pytest.mark.parametrize("max_tokens", [5, 40])
def test_a_tool_call_cut_by_max_tokens_sends_no_markup(client, max_tokens):
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris and in Rome?"}], tools=[weather],
              tool_choice="required", max_tokens=max_tokens, temperature=0)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "length" and msg.content is None
    content, calls = "", []
    for chunk in client.chat.completions.create(**kw, stream=True):
        content += chunk.choices[0].delta.content or ""
        calls += chunk.choices[0].delta.tool_calls or []
    assert content == "" and len(calls) == len(msg.tool_calls or [])


def test_logprobs_stop_where_a_stop_string_cuts_the_text(client):
    q = [{"role": "user", "content": "What is the capital of France?"}]
    kw = dict(model=MODEL, messages=q, max_tokens=24, temperature=0, logprobs=True, stop=[" of France"])
    r = client.chat.completions.create(**kw)
    text, tokens = r.choices[0].message.content, [t.token for t in r.choices[0].logprobs.content]
    assert text and "".join(tokens) == text
    streamed, stream_tokens = "", []
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices:
            streamed += chunk.choices[0].delta.content or ""
            stream_tokens += [t.token for t in chunk.choices[0].logprobs.content] if chunk.choices[0].logprobs else []
    assert (streamed, stream_tokens) == (text, tokens)
    done = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=12, temperature=0,
                                     logprobs=1, stop=["."])
    assert "".join(done.choices[0].logprobs.tokens) == done.choices[0].text
