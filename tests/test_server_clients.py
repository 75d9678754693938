"""The server as real clients drive it, with the request bodies they send (written out): lm-eval's
loglikelihood (echo + logprobs) and its remote tokenizer, langchain's nulls, guidellm's streaming
usage, penalties and logit_bias, and the openai client's models.retrieve."""
import json

import httpx
import pytest
import torch

from helpers.live_server import live_server

openai = pytest.importorskip("openai")
MODEL = "smol"
CONTEXT = "Question: What is the capital of France?\nAnswer:"
CHOICES = [" Paris", " London", " Berlin"]


@pytest.fixture(scope="module")
def url(model, tokenizer):
    with live_server(model, tokenizer, MODEL, max_model_len=512, max_num_batched_tokens=16) as s:
        yield s[0]            # (a budget of 16 tokens: the prompts below are scored in chunks)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def post(url, path, body):
    r = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def loglikelihood_by_hand(model, ctx, cont):
    """log p(cont | ctx) and whether cont is the greedy continuation, from the model's float32 logits."""
    ids = ctx + cont
    with torch.inference_mode():
        lp = torch.log_softmax(model(torch.tensor([ids]))[0].float(), dim=-1)    # (T, vocab)
    rows = lp[len(ctx) - 1:len(ids) - 1]                                        # the rows predicting cont
    return float(rows[torch.arange(len(cont)), torch.tensor(cont)].sum()), rows.argmax(-1).tolist() == cont


def lm_eval_parse(choice, ctxlen, max_tokens):
    """lm-eval's parse_logprobs: the continuation's summed token_logprobs (without the generated token
    when max_tokens is 1) and is_greedy (each token's logprob is its top alternative's)."""
    end = -1 if max_tokens else None
    tokens, tops = choice["logprobs"]["token_logprobs"][ctxlen:end], choice["logprobs"]["top_logprobs"][ctxlen:end]
    return sum(tokens), all(t == max(top.values()) for t, top in zip(tokens, tops))


@pytest.mark.parametrize("max_tokens", [1, 0])        # lm-eval sends 1; some versions send 0
def test_lm_eval_loglikelihood_equals_the_models_own(model, tokenizer, url, max_tokens):
    ctx = tokenizer.encode(CONTEXT)
    scores = {}
    for text in CHOICES:
        cont = tokenizer.encode(text)
        body = {"model": MODEL, "prompt": [ctx + cont], "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
                "seed": 1234, "echo": True}                                   # lm-eval's local-completions body
        choice = post(url, "/v1/completions", body)["choices"][0]
        lps = choice["logprobs"]
        assert len(lps["tokens"]) == len(lps["token_logprobs"]) == len(ctx + cont) + max_tokens
        assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
        assert choice["text"].startswith(tokenizer.decode(ctx + cont))
        got, greedy = lm_eval_parse(choice, len(ctx), max_tokens)
        want, want_greedy = loglikelihood_by_hand(model, ctx, cont)
        assert got == pytest.approx(want, abs=1e-3) and greedy == want_greedy
        scores[text] = got
    assert max(scores, key=scores.get) == " Paris"


def test_echo_text_offsets_and_streaming(tokenizer, url):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "echo": True,
            "logprobs": 2}
    whole = post(url, "/v1/completions", body)["choices"][0]
    lp = whole["logprobs"]
    assert whole["text"].startswith("The capital of France is")
    for tok, off in zip(lp["tokens"], lp["text_offset"]):
        assert whole["text"][off:off + len(tok)] == tok
    assert all(len(top) >= 2 for top in lp["top_logprobs"][1:])
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    streamed = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]
    assert [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]] == lp["text_offset"]


def test_lm_eval_remote_tokenizer_routes(tokenizer, url):
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["eos_token"] == tokenizer.id_to_piece(tokenizer.eos_id) and info["model_max_length"] == 512
    text = "Hello, world! <|im_end|>"
    got = post(url, "/tokenize", {"prompt": text, "add_special_tokens": False})   # RemoteTokenizer.encode's body
    assert got["tokens"] == tokenizer.encode(text) and got["count"] == len(got["tokens"])
    assert post(url, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})["tokens"] == \
        [tokenizer.eos_id]                                                      # how it finds eos_token_id
    assert post(url, "/detokenize", {"tokens": got["tokens"]})["prompt"] == text
    chat = post(url, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                   "return_token_strs": True})
    assert chat["tokens"] == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat["token_strs"][0] == "<|im_start|>"
    for path, body, param in [("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
                              ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
                              ("/tokenize", {"model": "gpt-4", "prompt": "a"}, "model")]:
        r = httpx.post(f"{url}{path}", json=body)
        assert r.status_code in (400, 404) and r.json()["error"]["param"] == param


def test_models_retrieve(client):
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_null_means_the_default(url):
    """langchain-openai's OpenAI (completions) sends these nulls on every call; chat clients send others."""
    langchain = {"model": MODEL, "prompt": ["Tell me a joke"], "temperature": 0.7, "top_p": 1, "frequency_penalty": 0,
                 "presence_penalty": 0, "n": 1, "logit_bias": {}, "seed": None, "logprobs": None, "max_tokens": 8}
    assert post(url, "/v1/completions", langchain)["choices"][0]["text"]
    nulls = {k: None for k in ("temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty",
                               "logprobs", "top_logprobs", "stop", "stream_options", "logit_bias", "user")}
    base = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6, "seed": 7}
    assert post(url, "/v1/chat/completions", base | nulls)["choices"][0]["message"] == \
        post(url, "/v1/chat/completions", base)["choices"][0]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json=base | {"bogus": None})       # unknown: still refused
    assert r.status_code == 400 and r.json()["error"]["param"] == "bogus"


def test_guidellm_streaming_usage_in_every_chunk(url):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "stop": None, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all(c["usage"] is not None for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and chunks[-1]["choices"] == []


def test_penalties_and_logit_bias(client, tokenizer):
    plain = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=4, temperature=0, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    banned = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=4, temperature=0, logprobs=0,
                                       logit_bias={str(tokenizer.encode(first)[0]): -100})
    assert banned.choices[0].logprobs.tokens[0] != first
    forced = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=3, temperature=0,
                                       logit_bias={str(tokenizer.encode(" banana")[0]): 100})
    assert forced.choices[0].text == " banana" * 3
    loose = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count to twenty"}],
                                           max_tokens=24, temperature=0, frequency_penalty=2.0, presence_penalty=2.0,
                                           extra_body={"repetition_penalty": 1.5})
    assert loose.choices[0].message.content
    for body, param in [({"presence_penalty": 3}, "presence_penalty"), ({"logit_bias": {"x": 1}}, "logit_bias"),
                        ({"logit_bias": {"99999999": 1}}, "logit_bias"), ({"repetition_penalty": 0}, "repetition_penalty"),
                        ({"echo": True, "max_tokens": 0, "n": 2}, "n"), ({"max_tokens": 0}, "max_tokens"),
                        ({"logprobs": 50}, "logprobs")]:
        r = httpx.post(f"{client.base_url}completions", json={"model": MODEL, "prompt": "hi"} | body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
