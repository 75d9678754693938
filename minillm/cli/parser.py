"""The command line's arguments: one parser, a subcommand per command."""
from __future__ import annotations

import argparse


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + error
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _add_model_args(p, stage: bool = True, many: bool = False):
    from ..generate import ALL_STAGES

    if many:
        p.add_argument("--model", action="append", default=None, metavar="[NAME=]PATH[:quant=FMT]",
                       help="a .gguf file or Hugging Face folder (default: the course model); repeat as NAME=PATH to "
                            "serve several models, each with its own engine (PATH may be empty: the course model; "
                            ":quant=q4 quantizes that one)")
    else:
        p.add_argument("--model", default=None, help="a .gguf file or Hugging Face folder (default: the course model)")
    if stage:
        p.add_argument("--stage", default="naive", choices=ALL_STAGES, help="which engine stage generates")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    _add_precision_args(p)
    _add_compile_arg(p)


def _add_compile_arg(p):
    p.add_argument("--backend", default="auto", choices=["auto", "torch", "native"],
                   help="the kernels: torch (PyTorch's operators), native (on a CPU: C loops for a decode's few "
                        "rows, a block in one C call, the C paged-attention kernel, each where it measures faster "
                        "here); default auto: native on a CPU, torch on a GPU (minillm/backends/)")
    p.add_argument("--compile", action="store_true",
                   help="compile each block's operators around attention with torch.compile (one compile "
                        "serves every layer; the first steps pay seconds for it, cached on disk); default: eager")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly: no CUDA graphs for decode steps (captured on a GPU by default) "
                        "and no --compile. The C kernels of the native backend are not turned off by it: "
                        "--backend torch does that (and serve's --no-pack-weights the packed weights)")


def _add_attention_arg(p):
    p.add_argument("--attention", default="auto", choices=["auto", "cpu", "torch", "triton"],
                   help="the engine's paged attention: cpu (a C kernel built here reads pages in place), torch "
                        "(pages gathered for SDPA), triton (the GPU kernels); default auto: triton on a GPU, "
                        "cpu with the native backend where a C compiler builds it, else torch")


def _add_precision_args(p):
    from .. import DTYPES
    from ..quant import FORMATS

    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="activations, norms and KV cache (and unquantized weights); default float32")
    p.add_argument("--quant", default=None, choices=list(FORMATS),
                   help="quantized weights: int8 (weight-only), w8a8 (int8 activations too), q4 (4-bit in groups "
                        "of 64, re-quantized: lossy), q4_file (the GGUF file's own 4-bit blocks); default: none")
    p.add_argument("--kv-cache-dtype", default=None, choices=["int8", "int4"],
                   help="store the KV cache quantized (stages kv, flash, paged, continuous and the server); default: --dtype")


def _add_sampling_args(p, max_tokens=128):
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=[], help="stop at this text (repeatable)")
    p.add_argument("--seed", type=int, default=None)


def _add_speculative_args(p):
    p.add_argument("--speculative", default=None, metavar="ngram|layers:N|draft:q4|ngram+draft:q4",
                   help="speculative decoding (stages kv, flash, paged, continuous): n-gram prompt lookup, "
                        "the model's first N layers as the draft, the model's own quantized copy as the draft "
                        "(draft:int8, draft:q4, draft:q4_file), or n-gram first and the copy when it finds nothing")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="the most drafts a step (default 8, or 4 with --no-adaptive-speculation)")
    p.add_argument("--adaptive-speculation", action=argparse.BooleanOptionalAction, default=None,
                   help="each sequence drafts 0..K tokens a step, where its acceptance and the measured cost of "
                        "the pass say it pays (default: on with --speculative; --no-adaptive-speculation drafts "
                        "K every step)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m minillm", description="minillm: a small LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    g = sub.add_parser("generate", help="generate text from a prompt, streaming")
    g.add_argument("prompt")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template as a user message")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_model_args(g)
    _add_sampling_args(g)
    _add_speculative_args(g)
    g.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="split the model across N processes of this machine (torch.distributed, gloo; the kv "
                        "stage, or the engine with --stage continuous; float32); N must divide the heads: 1 or 3 "
                        "for SmolLM2. Spawns the ranks itself, or is one of them under torchrun --nproc-per-node N. "
                        "Prints the answer at the end")

    c = sub.add_parser("chat", help="chat in the terminal (/reset clears, /exit or Ctrl-D quits)")
    c.add_argument("--system", default=None, help="a system message")
    _add_model_args(c)
    _add_sampling_args(c, max_tokens=256)
    _add_speculative_args(c)

    se = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                      "/v1/models, /health, /metrics)")
    se.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    se.add_argument("--port", type=int, default=8000)
    se.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    se.add_argument("--served-model-name", default=None, help="the name clients send as 'model' (default: the model's)")
    se.add_argument("--max-num-seqs", type=int, default=128,
                    help="sequences per step at most (default 128, as vLLM's CPU backend: with 128 requests at once, "
                         "one step for all of them gave more tokens/s than two batches of 64; "
                         "benchmarks/results/cpu_serving_vllm_seqs.json)")
    se.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per step at most (default 512)")
    se.add_argument("--kv-cache-memory", type=float, default=1.0, metavar="GIB", help="KV cache size (default 1 GiB)")
    se.add_argument("--max-model-len", type=int, default=None, help="context per request (default: the model's)")
    se.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    se.add_argument("--no-pack-weights", action="store_true",
                    help="on a CPU, no second copy of the float weights prepacked for big steps (by default the "
                         "native backend makes one where it measures faster: minillm/backends/packed.py)")
    se.add_argument("--max-queued-requests", type=int, default=None,
                    help="answer 503 when this many requests are already waiting (default: no limit)")
    se.add_argument("--max-tokens-default", type=int, default=1024,
                    help="tokens a request without max_tokens may generate (default 1024; never past the context)")
    se.add_argument("--graceful-timeout", type=float, default=30.0,
                    help="seconds running answers get to finish on shutdown (default 30)")
    se.add_argument("--route-threshold", type=float, default=None, metavar="T",
                    help="with two --model NAME=...: also serve model 'auto', answered by the first model and by the "
                         "last when the answer's confidence is below T (mean token log-probability, e.g. -0.5)")
    se.add_argument("--route-signal", default="mean", choices=["mean", "min", "entropy"],
                    help="the confidence 'auto' reads (default mean; see minillm/routing.py)")
    _add_model_args(se, stage=False, many=True)
    _add_attention_arg(se)
    _add_speculative_args(se)

    ex = sub.add_parser("export", help="write the model as a Hugging Face folder (config, safetensors, tokenizer, "
                                       "chat template) for transformers, vLLM, guidellm and lm-eval")
    ex.add_argument("dir", help="the folder to write (new or empty)")
    ex.add_argument("--model", default=None, help="a .gguf file (default: the course model)")
    ex.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="of the weights written (default float32: the weights minillm computes with)")

    co = sub.add_parser("course", help="open the course notebooks in JupyterLab")
    co.add_argument("--port", type=int, default=None)
    co.add_argument("--dry-run", action="store_true", help="print the command instead of running it")

    b = sub.add_parser("bench", help="stages: prefill and decode speed per stage on a prompt set; "
                                     "serve: requests arriving over time through the serving engine")
    b.add_argument("mode", nargs="?", choices=["stages", "serve"], default="stages",
                   help="stages (default) or serve")
    b.add_argument("--peer", choices=["transformers"], default=None,
                   help="also measure Hugging Face transformers on the same GGUF, in the same run")
    b.add_argument("--json", action="store_true", help="print only the JSON (default: JSON plus a table)")
    st = b.add_argument_group("bench stages")
    st.add_argument("--stages", default="naive", help="comma-separated stages, measured alternately")
    st.add_argument("--max-tokens", type=int, default=64)
    st.add_argument("--prompt-file", default=None, help=".jsonl ({'prompt', 'chat'}) or .txt (one per line)")
    st.add_argument("--repeats", type=int, default=1)
    sv = b.add_argument_group("bench serve")
    sv.add_argument("--num-requests", type=int, default=128)
    sv.add_argument("--request-rate", type=float, default=float("inf"),
                    help="Poisson arrivals per second (default inf: all at once)")
    sv.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most (and batch size)")
    sv.add_argument("--workload", default=None, help="a .jsonl trace with prompt_tokens and output_tokens per line "
                                                     "(default: data/request_trace.jsonl)")
    sv.add_argument("--length-scale", type=float, default=0.6, help="multiply the trace's lengths (default 0.6)")
    sv.add_argument("--systems", default="continuous,static", help="engine policies to run (continuous,static)")
    sv.add_argument("--max-num-batched-tokens", type=int, default=512, help="the engine's token budget per step")
    sv.add_argument("--shared-prefix-tokens", type=int, default=0,
                    help="every prompt starts with the same N tokens (a shared system prompt)")
    sv.add_argument("--no-prefix-caching", action="store_true", help="turn the engine's prefix cache off")
    _add_attention_arg(sv)
    sv.add_argument("--timeout", type=float, default=1800.0, help="seconds per system before giving up")
    sv.add_argument("--url", default=None, help="load-test a running OpenAI-compatible server at this address "
                                                "instead of the engine in this process")
    sv.add_argument("--chat", action="store_true", help="with --url: send /v1/chat/completions (default: completions)")
    sv.add_argument("--served-model-name", default=None, help="with --url: the 'model' to send (default: the "
                                                               "server's first in /v1/models)")
    sv.add_argument("--api-key", default=None, help="with --url: sent as a Bearer token")
    sv.add_argument("--no-ignore-eos", action="store_true",
                    help="with --url: do not send ignore_eos (for servers without it; outputs may end early)")
    b.add_argument("--model", default=None)
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--device", default=None)
    _add_precision_args(b)
    _add_compile_arg(b)
    return parser
