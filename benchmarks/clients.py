"""minillm's server driven by the clients people use, each through its own front door: whichever of
lm-eval, langchain-openai and guidellm are installed (this script installs nothing; a missing one is
reported as skipped), and the openai client, which comes with minillm.

    python benchmarks/clients.py [--json results/cpu_clients.json]

It starts `python -m minillm serve` on a free loopback port and runs:

- openai: chat (whole and streamed), a completion with echo + logprobs, models.retrieve;
- round trips: what the SDKs' helpers send back (message.model_dump(), nullable fields, pydantic_function_tool
  with $defs + parse), echo + logprobs for n = 3 against the model, a schema nothing satisfies, strict
  logit_bias keys and seeds, a tool call cut by max_tokens, chat logprobs with a stop string, a client that
  hangs up mid-body;
- lm-eval: `local-completions` with its remote tokenizer (/tokenizer_info, /tokenize) on a multiple-choice
  task read from data/capitals_mc.jsonl (nothing is fetched from a hub); each answer's loglikelihood is
  compared with the same sum computed from the model directly;
- langchain-openai: `OpenAI` (completions) and `ChatOpenAI` invoke and stream, and its structured output
  and tool binding (a pydantic sub-model too);
- guidellm (0.8, its `run` command): a short synchronous benchmark of streamed chat requests (its default
  request bodies), then its default `sweep` (synchronous, throughput, constant rates between them; each
  strategy --sweep-seconds long), with the tokenizer `python -m minillm export` writes (minillm's own ids)
  for its synthetic prompts.

Each check prints `pass`, `FAIL` (with the error) or `skipped`; --json writes them all.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NAME = "smol"
TASK = ROOT / "data" / "capitals_mc.jsonl"


def check(results: dict, client: str, name: str, fn) -> None:
    t0 = time.perf_counter()
    try:
        detail = fn()
        results.setdefault(client, {})[name] = {"ok": True, "detail": detail}
        print(f"  pass  {client}: {name}" + (f"  ({detail})" if detail else ""), flush=True)
    except Exception as e:  # noqa: BLE001  (a client's failure is the result being reported)
        results.setdefault(client, {})[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:500]}
        print(f"  FAIL  {client}: {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    results[client][name]["seconds"] = round(time.perf_counter() - t0, 2)


def installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


# ---------------------------------------------------------------- openai
def openai_checks(url: str, results: dict) -> None:
    import openai

    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    q = [{"role": "user", "content": "What is the capital of France?"}]
    check(results, "openai", "chat", lambda: c.chat.completions.create(model=NAME, messages=q, max_tokens=12,
                                                                       temperature=0).choices[0].message.content)
    check(results, "openai", "chat stream", lambda: "".join(
        ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=NAME, messages=q, max_tokens=12, temperature=0, stream=True) if ch.choices))

    def echo():
        r = c.completions.create(model=NAME, prompt="The capital of France is", max_tokens=1, temperature=0,
                                 echo=True, logprobs=1)
        lp = r.choices[0].logprobs
        assert lp.token_logprobs[0] is None and len(lp.tokens) == len(lp.token_logprobs)
        return f"{len(lp.tokens)} tokens scored"
    check(results, "openai", "completion echo + logprobs", echo)
    check(results, "openai", "models.retrieve", lambda: c.models.retrieve(NAME).id)


# ---------------------------------------------------------------- round trips: what the SDKs' helpers send back
def round_trip_checks(url: str, results: dict, model, tok) -> None:
    import socket
    from enum import Enum

    import httpx
    import openai
    import torch
    from pydantic import BaseModel

    c = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    R = "round trips"

    def post(path, body, status=200):
        r = httpx.post(f"{url}{path}", json=body, timeout=120)
        assert r.status_code == status, f"{r.status_code}: {r.text[:300]}"
        return r.json()

    def model_dump_loop():
        messages = [{"role": "user", "content": "Name a colour."}]
        first = c.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
        messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "Another?"}]
        return c.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0
                                         ).choices[0].message.content
    check(results, R, "messages.append(message.model_dump())", model_dump_loop)

    def nullable_fields():
        body = {"model": NAME, "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}
        post("/v1/chat/completions", body | {k: None for k in ("store", "metadata", "service_tier",
                                                                 "reasoning_effort")})
        post("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 4, "best_of": None, "suffix": None})
        err = post("/v1/chat/completions", body | {"store": True}, 400)["error"]
        return f"nulls taken; store: true -> 400 naming {err['param']!r}"
    check(results, R, "OpenAI's nullable fields", nullable_fields)

    def parse_with_defs():
        class Unit(str, Enum):
            c = "c"
            f = "f"

        class GetWeather(BaseModel):
            city: str
            unit: Unit

        r = c.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": "Weather in Paris, in c?"}],
                                     tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
                                     max_tokens=60, temperature=0)
        return repr(r.choices[0].message.tool_calls[0].function.parsed_arguments)
    check(results, R, "pydantic_function_tool ($defs) + parse", parse_with_defs)

    def echo_n():
        body = {"model": NAME, "prompt": "The cat sat on the", "max_tokens": 2, "echo": True, "logprobs": 1, "n": 3,
                "temperature": 1, "seed": 1}
        prompt, worst = tok.encode(body["prompt"]), 0.0
        for ch in post("/v1/completions", body)["choices"]:
            lp = ch["logprobs"]
            assert "".join(lp["tokens"]) == ch["text"], ch
            ids = prompt + [tok.encode(t)[0] for t in lp["tokens"][len(prompt):]]
            with torch.inference_mode():
                ref = torch.log_softmax(model(torch.tensor([ids]))[0], -1)[torch.arange(len(ids) - 1),
                                                                           torch.tensor(ids[1:])]
            worst = max(worst, max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], ref.tolist())))
        assert worst < 2e-3, worst
        return f"3 choices, each its own tokens; logprobs within {worst:.1e} of the model's"
    check(results, R, "echo + logprobs, n = 3", echo_n)

    def unsatisfiable():
        loop = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
        err = post("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                                            "response_format": {"type": "json_schema", "json_schema": {
                                                "name": "x", "schema": loop}}}, 400)["error"]
        return err["message"][:80]
    check(results, R, "a schema nothing satisfies: 400", unsatisfiable)

    def strict_values():
        for bad in (" 7", "1_0", "\u0663"):
            post("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 1, "logit_bias": {bad: 1}}, 400)
        err = post("/v1/completions", {"model": NAME, "prompt": "hi", "max_tokens": 1, "seed": 2**64}, 400)["error"]
        return f"logit_bias keys refused; seed 2**64: {err['message'][:60]}"
    check(results, R, "logit_bias keys and seed range", strict_values)

    def cut_call():
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
        r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Weather in Rome?"}],
                                      tools=[tool], tool_choice="required", max_tokens=5, temperature=0)
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None, r.choices[0]
        return "finish_reason length, no markup in content"
    check(results, R, "a tool call cut by max_tokens", cut_call)

    def stop_logprobs():
        r = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                      max_tokens=24, temperature=0, logprobs=True, stop=[" of France"])
        tokens = [t.token for t in r.choices[0].logprobs.content]
        assert "".join(tokens) == r.choices[0].message.content, (tokens, r.choices[0].message.content)
        return f"{len(tokens)} tokens for {r.choices[0].message.content!r}"
    check(results, R, "chat logprobs with a stop string", stop_logprobs)

    def hang_up():
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
            time.sleep(0.2)
        time.sleep(0.3)
        assert httpx.get(f"{url}/health").status_code == 200
        return "healthy after (the server's log: tests/test_server_round_trips.py checks it has no traceback)"
    check(results, R, "a client that hangs up mid-body", hang_up)


# ---------------------------------------------------------------- lm-eval
TASK_YAML = """task: minillm_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def by_hand(model, tok, docs) -> list[list[float]]:
    """Each choice's loglikelihood after its question, from the model's float32 logits."""
    import torch

    out = []
    for d in docs:
        ctx = tok.encode(f"Question: {d['question']}\nAnswer:")
        row = []
        for choice in d["choices"]:
            cont = tok.encode(" " + choice)
            with torch.inference_mode():
                lp = torch.log_softmax(model(torch.tensor([ctx + cont]))[0].float(), dim=-1)
            rows = lp[len(ctx) - 1:len(ctx) + len(cont) - 1]
            row.append(float(rows[torch.arange(len(cont)), torch.tensor(cont)].sum()))
        out.append(row)
    return out


def lm_eval_checks(url: str, results: dict, model, tok) -> None:
    if not installed("lm_eval"):
        results["lm-eval"] = "skipped: not installed (pip install lm-eval)"
        print("  skipped  lm-eval (pip install lm-eval)")
        return
    import lm_eval
    from lm_eval.tasks import TaskManager

    docs = [json.loads(line) for line in TASK.read_text().splitlines()]

    def mc():
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "minillm_capitals.yaml").write_text(TASK_YAML.format(path=TASK))
            res = lm_eval.simple_evaluate(
                model="local-completions", tasks=["minillm_capitals"], task_manager=TaskManager(include_path=tmp),
                model_args=f"model={NAME},base_url={url}/v1/completions,tokenizer_backend=remote,num_concurrent=1",
                log_samples=True)
        samples = res["samples"]["minillm_capitals"]
        want = by_hand(model, tok, docs)
        worst = 0.0
        for s in samples:
            got = [r[0][0] for r in s["resps"]]
            worst = max(worst, max(abs(a - b) for a, b in zip(got, want[s["doc_id"]])))
        acc = res["results"]["minillm_capitals"]["acc,none"]
        mine = sum(max(range(4), key=w.__getitem__) == d["answer"] for w, d in zip(want, docs)) / len(docs)
        assert worst < 1e-3 and acc == mine, f"lm-eval acc {acc}, by hand {mine}; largest loglikelihood gap {worst}"
        return f"acc {acc:.3f} on {len(docs)} questions, the same as by hand; loglikelihoods within {worst:.1e}"
    check(results, "lm-eval", "multiple choice (loglikelihood, remote tokenizer)", mc)

    def generate_until():
        with tempfile.TemporaryDirectory() as tmp:
            yaml = TASK_YAML.format(path=TASK).replace("output_type: multiple_choice", "output_type: generate_until")
            yaml = yaml.replace('doc_to_choice: "{{choices}}"\n', "")
            yaml = yaml.replace('doc_to_target: "{{answer}}"', 'doc_to_target: "{{choices[answer]}}"')
            yaml = yaml.replace("  - metric: acc", "  - metric: exact_match")
            yaml += "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 8\n"
            (Path(tmp) / "minillm_capitals_gen.yaml").write_text(yaml.replace("task: minillm_capitals",
                                                                             "task: minillm_capitals_gen"))
            res = lm_eval.simple_evaluate(
                model="local-completions", tasks=["minillm_capitals_gen"], task_manager=TaskManager(include_path=tmp),
                model_args=f"model={NAME},base_url={url}/v1/completions,tokenizer_backend=remote,num_concurrent=1")
        return f"exact match {res['results']['minillm_capitals_gen']['exact_match,none']:.3f}"
    check(results, "lm-eval", "generate_until", generate_until)


# ---------------------------------------------------------------- langchain-openai
def langchain_checks(url: str, results: dict) -> None:
    if not installed("langchain_openai"):
        results["langchain-openai"] = "skipped: not installed (pip install langchain-openai)"
        print("  skipped  langchain-openai (pip install langchain-openai)")
        return
    from langchain_openai import ChatOpenAI, OpenAI

    kw = {"model": NAME, "base_url": f"{url}/v1", "api_key": "unused", "max_retries": 0}
    llm, chat = OpenAI(max_tokens=12, temperature=0, **kw), ChatOpenAI(max_tokens=12, temperature=0, **kw)
    L = "langchain-openai"
    check(results, L, "OpenAI.invoke", lambda: llm.invoke("The capital of France is"))
    check(results, L, "OpenAI.stream", lambda: "".join(llm.stream("The capital of France is")))
    check(results, L, "ChatOpenAI.invoke", lambda: chat.invoke("What is the capital of France?").content)
    check(results, L, "ChatOpenAI.stream", lambda: "".join(c.content for c in chat.stream("Capital of France?")))

    schema = {"title": "City", "description": "a city", "type": "object",
              "properties": {"name": {"type": "string"}, "country": {"type": "string"}}, "required": ["name", "country"]}
    big = ChatOpenAI(max_tokens=64, temperature=0, **kw)
    check(results, L, "with_structured_output (json_schema)",
          lambda: big.with_structured_output(schema, method="json_schema").invoke("Name a city in France."))
    check(results, L, "with_structured_output (function_calling)",
          lambda: big.with_structured_output(schema, method="function_calling").invoke("Name a city in France."))
    check(results, L, "bind_tools (auto: a call or text)",
          lambda: answer_or_calls(big.bind_tools([schema]).invoke("Name a city in France.")))
    check(results, L, "bind_tools (tool_choice any)",
          lambda: one_call(big.bind_tools([schema], tool_choice="any").invoke("Name a city in France."), "City"))

    from pydantic import BaseModel

    class Place(BaseModel):
        city: str
        country: str

    class Book(BaseModel):
        """Book a hotel."""
        place: Place
        nights: int

    def nested():
        calls = one_call(big.bind_tools([Book], tool_choice="any").invoke("Book two nights in Lyon, France."), "Book")
        assert set(calls[0]["args"]) <= {"place", "nights"} and set(calls[0]["args"]["place"]) <= {"city", "country"}
        return calls
    check(results, L, "bind_tools with a pydantic sub-model (nested object)", nested)


def answer_or_calls(message) -> str:
    return f"calls {message.tool_calls}" if message.tool_calls else f"text {message.content!r}"


def one_call(message, name: str):
    """The tool calls of a langchain AIMessage that must call `name` (an error otherwise)."""
    if not message.tool_calls or any(c["name"] != name for c in message.tool_calls):
        raise AssertionError(f"expected calls of {name}; got {message.tool_calls} and content {message.content!r}")
    return message.tool_calls


# ---------------------------------------------------------------- guidellm
def guidellm_checks(url: str, results: dict, tmp: Path) -> None:
    exe = _guidellm()
    if exe is None:
        results["guidellm"] = "skipped: not installed (pip install guidellm)"
        print("  skipped  guidellm (pip install guidellm)")
        return

    def bench():
        processor = tmp / "tokenizer"
        write_tokenizer(processor)
        out, scenario = tmp / "guidellm.json", tmp / "scenario.json"
        scenario.write_text(json.dumps({"spec": {      # guidellm 0.8's scenario file (its `run` command)
            "backend": {"kind": "openai_http", "target": url, "model": NAME},
            "profile": {"kind": "synchronous"},
            "tokenizer": {"kind": "huggingface_auto", "model": str(processor)},
            "data": [{"kind": "synthetic_text", "prompt_tokens": 32, "output_tokens": 8}],
            "constraints": [{"kind": "max_requests", "count": 6}],
            "outputs": [{"kind": "json", "path": str(out)}]}}))
        r = subprocess.run([exe, "run", "-c", str(scenario), "--disable-console-interactive"], capture_output=True,
                           text=True, timeout=900, cwd=tmp)
        assert r.returncode == 0, (r.stdout + r.stderr)[-1500:]
        counts = _guidellm_counts(json.loads(out.read_text()))
        assert counts.get("errored", 0) == 0 and counts.get("successful", 0) > 0, counts
        return f"requests {counts}"
    check(results, "guidellm", "run (synchronous, streamed chat)", bench)


def guidellm_sweep(url: str, results: dict, tmp: Path, seconds: float) -> None:
    """guidellm's default benchmark (its `sweep` profile: synchronous, throughput, then constant rates between
    the two) of streamed chat requests, 256 prompt tokens and 128 answer tokens as its docs' example, each
    strategy for `seconds`; its throughput step capped at 16 streams (guidellm's default, 512,
    sends more than a 2-core CPU finishes within the time: no request would complete, and the sweep would
    place its constant rates below the synchronous one). The table goes into results["guidellm sweep"]."""
    exe = _guidellm()
    if exe is None:
        results["guidellm sweep"] = "skipped: not installed (pip install guidellm)"
        return
    processor = tmp / "tokenizer"
    write_tokenizer(processor)
    out, scenario = tmp / "sweep.json", tmp / "sweep_scenario.json"
    scenario.write_text(json.dumps({"spec": {
        "backend": {"kind": "openai_http", "target": url, "model": NAME},
        "profile": {"kind": "sweep", "sweep_size": 5, "max_concurrency": 16},
        "tokenizer": {"kind": "huggingface_auto", "model": str(processor)},
        "data": [{"kind": "synthetic_text", "prompt_tokens": 256, "output_tokens": 128}],
        "constraints": [{"kind": "max_duration", "seconds": seconds}],
        "outputs": [{"kind": "json", "path": str(out)}]}}))
    r = subprocess.run([exe, "run", "-c", str(scenario), "--disable-console-interactive"], capture_output=True,
                       text=True, timeout=int(12 * seconds + 600), cwd=tmp)
    if r.returncode != 0:
        results["guidellm sweep"] = {"error": (r.stdout + r.stderr)[-1500:]}
        print("  FAIL  guidellm sweep:", (r.stdout + r.stderr)[-500:])
        return
    rows = []
    for b in json.loads(out.read_text())["benchmarks"]:
        m, st = b["metrics"], b["config"]["strategy"]
        ok = lambda key, stat="median": (m[key]["successful"] or {}).get(stat)   # noqa: E731
        pct = lambda key, p: ((m[key]["successful"] or {}).get("percentiles") or {}).get(p)   # noqa: E731
        rows.append({"strategy": st["type_"] + (f"@{st['rate']:.2f}" if st.get("rate") else ""),
                     "successful": m["request_totals"]["successful"], "errored": m["request_totals"]["errored"],
                     "incomplete": m["request_totals"]["incomplete"],
                     "requests_per_s": m["requests_per_second"]["successful"]["mean"],
                     "output_tokens_per_s": m["output_tokens_per_second"]["total"]["mean"],
                     "ttft_ms_p50": ok("time_to_first_token_ms"), "ttft_ms_p95": pct("time_to_first_token_ms", "p95"),
                     "itl_ms_p50": ok("inter_token_latency_ms"), "itl_ms_p95": pct("inter_token_latency_ms", "p95"),
                     "latency_s_p50": ok("request_latency")})
    results["guidellm sweep"] = {"seconds_per_strategy": seconds, "prompt_tokens": 256, "output_tokens": 128,
                                 "rows": rows}
    print(f"  guidellm sweep ({seconds:.0f} s per strategy, 256 prompt / 128 answer tokens, streamed chat):")
    print(f"  {'strategy':16}{'ok':>5}{'err':>5}{'req/s':>7}{'out tok/s':>10}{'TTFT p50':>10}{'p95':>8}"
          f"{'ITL p50':>9}{'p95':>7}  (ms)")
    for w in rows:
        f = lambda v, d=0: "-" if v is None else f"{v:.{d}f}"   # noqa: E731
        print(f"  {w['strategy']:16}{w['successful']:>5}{w['errored']:>5}{f(w['requests_per_s'], 2):>7}"
              f"{f(w['output_tokens_per_s'], 1):>10}{f(w['ttft_ms_p50']):>10}{f(w['ttft_ms_p95']):>8}"
              f"{f(w['itl_ms_p50']):>9}{f(w['itl_ms_p95']):>7}")


def _guidellm() -> str | None:
    beside = Path(sys.executable).parent / "guidellm"          # this Python's environment first, then PATH
    return str(beside) if beside.exists() else shutil.which("guidellm")


def _guidellm_counts(report) -> dict:
    """successful / errored / incomplete request counts, wherever this version of guidellm puts them."""
    found: dict = {}

    def walk(x):
        if isinstance(x, dict):
            rt = x.get("request_totals") or x.get("requests_made")
            if isinstance(rt, dict) and not found:          # (both name the same requests: count once)
                for k in ("successful", "errored", "incomplete"):
                    if isinstance(rt.get(k), int):
                        found[k] = found.get(k, 0) + rt[k]
                return
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(report)
    return found


def write_tokenizer(folder: Path) -> None:
    """The model's tokenizer as `python -m minillm export` writes it (guidellm counts tokens with one): the same
    ids as minillm's, digits split as SmolLM2 splits them."""
    from minillm.export import export_tokenizer

    export_tokenizer(folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--sweep-seconds", type=float, default=90,
                    help="guidellm's sweep: seconds per strategy (0: no sweep); default 90")
    args = ap.parse_args()

    import minillm
    from minillm.course.bench import machine_info, machine_label, provenance
    from minillm.course.launch_server import ServerProcess

    model, tok = minillm.load_model(), minillm.load_tokenizer()
    results: dict = {"machine": machine_info(), **provenance()}
    with tempfile.TemporaryDirectory() as tmp, \
            ServerProcess.minillm(["--served-model-name", NAME, "--max-model-len", "2048"]) as srv:
        print(f"minillm serve at {srv.url}; {machine_label(results['machine'])}")
        openai_checks(srv.url, results)
        round_trip_checks(srv.url, results, model, tok)
        lm_eval_checks(srv.url, results, model, tok)
        langchain_checks(srv.url, results)
        guidellm_checks(srv.url, results, Path(tmp))
        if args.sweep_seconds > 0:
            guidellm_sweep(srv.url, results, Path(tmp), args.sweep_seconds)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
