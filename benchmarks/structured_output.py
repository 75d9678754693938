"""What structured output costs: compiling a schema, the token mask per step, and the engine's decode step.

    python benchmarks/structured_output.py [--out benchmarks/results/cpu_structured_output.json]

1. The grammar library on its own, for five JSON schemas (nested objects, enums and numbers, arrays,
   any JSON): building the vocabulary's index once, compiling each schema, and computing the mask of
   every step along a valid answer at batch 1 and 32 (the median step). llguidance is what the engine
   uses; xgrammar (the other library vLLM and SGLang use) takes its turn beside it when it is installed
   (`pip install xgrammar`), on the same tokens.
   Beside each llguidance mask, the cost of applying it: the bitmask unpacked to one bool per token and
   the banned logits set to -inf.
2. The engine: a decode-only step at batch 1 and 32, every request with a grammar and with none,
   the two taking turns step by step (the ratio is the median of step-by-step ratios, with its quartiles);
   and the share of the constrained step spent computing the masks and turning them into logit biases.
Notebook 11 plots the result.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

import torch
from tqdm import tqdm

import minillm
from minillm import structured
from minillm.course.bench import machine_info, provenance
from minillm.course.quality import heldout_ids
from minillm.engine import LLMEngine
from minillm.sampling import SamplingParams

SCHEMAS = {
    "person": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                "required": ["name", "age"]},
               {"name": "Ada Lovelace", "age": 36}),
    "nested": ({"type": "object", "properties": {
                    "user": {"type": "object", "properties": {
                        "name": {"type": "string"},
                        "address": {"type": "object", "properties": {
                            "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                            "required": ["city", "zip"]}},
                        "required": ["name", "address"]},
                    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
                "required": ["user", "tags"]},
               {"user": {"name": "Grace Hopper", "address": {"city": "Arlington", "zip": "22201"}},
                "tags": ["navy", "cobol"]}),
    "enum_numbers": ({"type": "object", "properties": {
                          "status": {"enum": ["ok", "warn", "fail"]},
                          "score": {"type": "number", "minimum": 0, "maximum": 1},
                          "count": {"type": "integer"}, "done": {"type": "boolean"}},
                      "required": ["status", "score", "count", "done"]},
                     {"status": "warn", "score": 0.75, "count": 12, "done": False}),
    "array_of_objects": ({"type": "array", "items": {"type": "object", "properties": {
                              "city": {"type": "string"}, "population": {"type": "integer"}},
                              "required": ["city", "population"]}, "minItems": 1, "maxItems": 5},
                         [{"city": "Paris", "population": 2100000}, {"city": "Lyon", "population": 520000}]),
    "any_json": ({}, {"answer": "Paris is the capital of France.", "confidence": 0.9, "sources": ["atlas"]}),
}
# The engine's grammar: an array of at least 200 integers, so no constrained request ends before the
# step count does (each round decodes the same number of tokens with and without it).
ENGINE_SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 200}


def ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ------------------------------------------------------------ 1. the libraries
def llguidance_side(tok, batches) -> dict:
    """llguidance through minillm.structured: what the engine runs."""
    structured._ll_tokenizer.cache_clear()
    setup = timed(lambda: structured._ll_tokenizer(tok))
    out = {"tokenizer_setup_ms": setup * 1e3, "schemas": {}}
    for name, (schema, answer) in SCHEMAS.items():
        grammar, compile_s = None, []
        for _ in range(3):
            t0 = time.perf_counter()
            grammar = structured.json_schema_grammar(schema)
            structured.Constraint(grammar, tok)                  # compiling happens when a matcher is made
            compile_s.append(time.perf_counter() - t0)
        ids = tok.encode(structured.schema_text(answer))
        r = {"compile_ms": ms(compile_s), "steps": len(ids)}
        for B in batches:
            cs = [structured.Constraint(grammar, tok) for _ in range(B)]
            mask = structured.allocate_bitmask(B, tok.vocab_size)
            logits = torch.randn(B, tok.vocab_size)
            one_by_one, parallel, apply = [], [], []
            for t in ids:
                one_by_one.append(timed(lambda: [c.fill(mask[i]) for i, c in enumerate(cs)]))
                parallel.append(timed(lambda: structured.fill_bitmasks(cs, mask)))
                apply.append(timed(lambda: structured.apply_bitmask(logits, mask)))
                assert structured.bitmask_to_bool(mask, tok.vocab_size)[:, t].all(), (name, t)
                assert all(c.accept(t) for c in cs), (name, t)
            assert all(c.done for c in cs), name
            r[f"mask_ms_b{B}"] = ms(parallel)
            r[f"mask_ms_b{B}_one_thread"] = ms(one_by_one)
            r[f"apply_ms_b{B}"] = ms(apply)
        out["schemas"][name] = r
    return out


def xgrammar_side(tok, batches) -> dict | None:
    """The same work in xgrammar, if it is installed (compact JSON, the same stop tokens)."""
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    vocab = structured.token_bytes(tok)
    info = None

    def setup():
        nonlocal info
        info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, stop_token_ids=sorted(tok.stop_ids))
    out = {"version": version("xgrammar"), "tokenizer_setup_ms": timed(setup) * 1e3, "schemas": {}}

    def compile_(schema):
        compiler = xgr.GrammarCompiler(info, max_threads=torch.get_num_threads(), cache_enabled=False)
        if not schema:
            return compiler.compile_builtin_json_grammar()
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))

    for name, (schema, answer) in SCHEMAS.items():
        compiled, compile_s = None, []
        for _ in range(3):
            t0 = time.perf_counter()
            compiled = compile_(schema)
            compile_s.append(time.perf_counter() - t0)
        ids = tok.encode(structured.schema_text(answer))
        r = {"compile_ms": ms(compile_s), "steps": len(ids)}
        for B in batches:
            ms_ = [xgr.GrammarMatcher(compiled) for _ in range(B)]
            mask = xgr.allocate_token_bitmask(B, tok.vocab_size)
            steps = []
            for t in ids:
                steps.append(timed(lambda: [m.fill_next_token_bitmask(mask, i) for i, m in enumerate(ms_)]))
                assert (mask[0, t // 32] >> (t % 32)) & 1, (name, t)
                assert all(m.accept_token(t) for m in ms_), (name, t)
            r[f"mask_ms_b{B}"] = ms(steps)
        out["schemas"][name] = r
    return out


# ------------------------------------------------------------ 2. the engine's step
def decoding(model, tok, B: int, grammar: str | None, prompt_tokens: int) -> LLMEngine:
    """An engine with B greedy requests, every prompt in: its next steps decode B tokens each."""
    text = heldout_ids(tok)
    engine = LLMEngine(model, tok, max_num_seqs=B, max_num_batched_tokens=512, attention="torch", verbose=False)
    params = SamplingParams(max_tokens=256, grammar=grammar) if grammar else SamplingParams(max_tokens=256,
                                                                                          ignore_eos=True)
    for i in range(B):
        start = (i * 37) % (len(text) - prompt_tokens)
        engine.add_request(str(i), text[start:start + prompt_tokens], params)
    while engine.last_batch is None or engine.last_batch.total_tokens != B:
        engine.step()
    return engine


def engine_steps(model, tok, batches, rounds: int, steps: int, prompt_tokens: int) -> dict:
    """Per batch size: an engine whose requests decode under a grammar and one whose requests decode freely,
    their steps taking turns one by one (so a slow second of the machine hits both), and the share of the
    constrained step spent in `_grammar_masks`: computing the masks and turning them into logit biases."""
    grammar = structured.json_schema_grammar(ENGINE_SCHEMA)
    walls = {(B, g): [] for B in batches for g in (False, True)}
    masks = {B: [] for B in batches}
    for B in batches:
        for _ in tqdm(range(rounds), desc=f"engine steps, batch {B}", file=sys.stderr):
            engines = {g: decoding(model, tok, B, grammar if g else None, prompt_tokens) for g in (False, True)}
            inner = engines[True]._grammar_masks

            def timed_masks(*args, _inner=inner, _B=B):           # the mask's share of a step, timed from outside
                t0 = time.perf_counter()
                out = _inner(*args)
                masks[_B].append(time.perf_counter() - t0)
                return out
            engines[True]._grammar_masks = timed_masks
            for e in engines.values():
                e.step()                                           # warm-up
            masks[B].pop()                                         # the warm-up step's masks: not counted
            for _ in range(steps):
                for g, e in engines.items():                       # taking turns, step by step
                    walls[B, g].append(timed(e.step))
                    assert e.last_batch.total_tokens == B
            for e in engines.values():
                assert all(not r.finished for r in e.requests.values())
            del engines
    out = {}
    for B in batches:
        free, con = ms(walls[B, False]), ms(walls[B, True])
        ratios = [c / f for f, c in zip(walls[B, False], walls[B, True])]      # step by step
        q = statistics.quantiles(ratios, n=4)
        out[f"b{B}"] = {"step_ms_free": free, "step_ms_grammar": con, "grammar_over_free": statistics.median(ratios),
                        "grammar_over_free_quartiles": [q[0], q[2]], "steps": len(ratios),
                        "mask_ms_in_step": ms(masks[B]), "mask_share_of_step": ms(masks[B]) / con}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12, help="timed decode steps per engine and round")
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_structured_output.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = (1, 32)
    model, tok = minillm.load_model(), minillm.load_tokenizer()
    result = {"machine": machine_info(), **provenance(), "batches": list(batches), "schemas": {k: s for k, (s, _) in SCHEMAS.items()},
              "llguidance": llguidance_side(tok, batches), "xgrammar": xgrammar_side(tok, batches),
              }
    result["llguidance"]["version"] = version("llguidance")
    for side in ("llguidance", "xgrammar"):
        if result[side]:
            print(side, json.dumps(result[side], default=lambda x: round(x, 3)), flush=True)
    result["engine"] = engine_steps(model, tok, batches, args.rounds, args.steps, args.prompt_tokens)
    result["engine_setup"] = {"schema": ENGINE_SCHEMA, "prompt_tokens": args.prompt_tokens, "rounds": args.rounds,
                              "steps_per_round": args.steps, "attention": "torch", "dtype": "float32"}
    print(json.dumps(result["engine"], indent=1), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
