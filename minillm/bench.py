"""Benchmark harness: the same prompts through each stage, in one process, alternating.

Prints/returns one JSON-able dict:
    {"machine": ..., "torch": ..., "threads": ..., "max_tokens": ..., "prompts": [...],
     "results": [{"stage", "prefill_tokens_per_s", "ttft_s", "decode_tokens_per_s", "ratio_to_first", ...}]}

Numbers are medians over prompts x repeats. Stages take turns prompt by prompt, so a
slow patch of the machine (another process, thermal throttling) hits all of them.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from .generate import generate
from .sampling import SamplingParams

DEFAULT_PROMPTS = Path(__file__).resolve().parent.parent / "data" / "prompts.jsonl"


def machine_info() -> dict:
    """CPU model, core count, GPU (if any) and library versions: name the hardware behind a number."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "torch": torch.__version__,
            "threads": torch.get_num_threads(), "python": platform.python_version()}


def load_prompts(path: str | Path | None = None) -> list[dict]:
    """Prompts from a .jsonl file ({"prompt", "chat"} per line) or a .txt file (one prompt per line)."""
    path = Path(path) if path else DEFAULT_PROMPTS
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist")
    if path.suffix == ".jsonl":
        prompts = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        prompts = [{"prompt": line, "chat": False} for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"prompt file {path} holds no prompts")
    return prompts


def prompt_ids(tokenizer, p: dict) -> list[int]:
    if p.get("chat"):
        return tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}])
    return tokenizer.encode(p["prompt"])


def run_bench(model, tokenizer, stages: list[str], prompts: list[dict], max_tokens: int = 64,
              repeats: int = 1, warmup: bool = True) -> dict:
    params = SamplingParams(max_tokens=max_tokens)
    encoded = [prompt_ids(tokenizer, p) for p in prompts]
    if warmup:  # first calls pay for allocations and lazy init; keep them out of the numbers
        for stage in stages:
            generate(model, tokenizer, encoded[0], SamplingParams(max_tokens=4), stage)
    runs = {s: [] for s in stages}
    jobs = [(r, i, s) for r in range(repeats) for i in range(len(encoded)) for s in stages]
    for r, i, stage in tqdm(jobs, desc="bench", disable=None):
        g = generate(model, tokenizer, encoded[i], params, stage)
        runs[stage].append(g)
    results = []
    for stage in stages:
        gs = runs[stage]
        results.append({
            "stage": stage,
            "prefill_tokens_per_s": statistics.median(g.prefill_tokens_per_s for g in gs),
            "ttft_s": statistics.median(g.ttft_s for g in gs),
            "decode_tokens_per_s": statistics.median(g.decode_tokens_per_s for g in gs),
            "mean_prompt_tokens": statistics.mean(g.prompt_tokens for g in gs),
            "mean_new_tokens": statistics.mean(len(g.token_ids) for g in gs),
            "runs": len(gs),
        })
    first = results[0]["decode_tokens_per_s"]
    for r in results:
        r["ratio_to_first"] = r["decode_tokens_per_s"] / first if first else None
    info = machine_info()
    return {"machine": info["cpu"], "gpu": info["gpu"], "torch": info["torch"], "threads": info["threads"],
            "max_tokens": max_tokens, "repeats": repeats, "prompts": [p.get("name", p["prompt"][:30]) for p in prompts],
            "results": results}
