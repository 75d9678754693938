"""The Triton kernels' checks that notebooks 05-06 run live, saved for machines without Triton (macOS,
Windows), where the notebooks show these committed results instead.

    python benchmarks/kernel_checks.py          # writes benchmarks/results/cpu_kernel_checks.json
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported: the CPU runs the interpreter
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import minillm  # noqa: E402
from minillm.course.kernel_checks import flash_kernel_checks# noqa: E402
from minillm.course.bench import machine_info, provenance  # noqa: E402
from minillm.generate import generate  # noqa: E402
from minillm.sampling import SamplingParams  # noqa: E402


def main() -> None:
    tok, model = minillm.load_tokenizer(), minillm.load_model(device="cpu")   # the CPU's results, on any machine
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    runs = {stage: generate(model, tok, ids, params, stage=stage) for stage in ("naive", "flash", "paged")}
    out = {"machine": machine_info(), **provenance(), "flash": flash_kernel_checks(device="cpu"),
           "stages": {stage: {"token_ids": g.token_ids, "text": g.text} for stage, g in runs.items()},
           "same_tokens_as_naive": {s: runs[s].token_ids == runs["naive"].token_ids for s in ("flash", "paged")}}
    path = Path(__file__).resolve().parent / "results" / "cpu_kernel_checks.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["same_tokens_as_naive"]), "->", path)


if __name__ == "__main__":
    main()
