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
import subprocess
import time
from pathlib import Path

import torch
from tqdm import tqdm

from ..generate import Generation, generate
from .roofline import measure_read_bandwidth, weight_bytes
from ..sampling import SamplingParams

DEFAULT_PROMPTS = Path(__file__).resolve().parents[2] / "data" / "prompts.jsonl"


def _cpu_name() -> str:
    """The CPU's marketing name: /proc/cpuinfo on Linux, sysctl on macOS, platform elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip() or platform.machine()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


# CPU features that change which kernel is fastest (and how fbgemm adds): bfloat16 and int8 matrix units
CPU_FEATURES = ("avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def machine_info() -> dict:
    """CPU model, core count, memory, GPU (if any) and library versions: name the hardware behind a number.
    cpu_capability: the ATen kernels in use (AVX512, AVX2, DEFAULT, ...); cpu_features: the matrix
    instructions among CPU_FEATURES the CPU has."""
    import psutil

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    caps = torch.cpu.get_capabilities()
    return {"cpu": _cpu_name(), "cores": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "gpu": gpu, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version(), "os": platform.system(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_features": [f for f in CPU_FEATURES if caps.get(f)]}


def provenance() -> dict:
    """Which code made a result, and when: {"commit": short hash (with "+ uncommitted changes" when the
    work tree differs), "date": UTC}. Commit it beside machine_info() in every results JSON."""
    root = Path(__file__).resolve().parents[2]

    def git(*args):
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    # changed code (the package, the benchmark scripts, the build), not results, notebooks or prose
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "minillm", "benchmarks/*.py", "pyproject.toml")
    return {"commit": commit + (" + uncommitted changes" if dirty else ""),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def machine_label(info: dict | None = None) -> str:
    """One line for a figure's title: 'AMD EPYC (AVX2) · 2 cores, 2 threads · 23.5 GiB' (and the GPU, if any)."""
    info = info or machine_info()
    if isinstance(info, str):                          # older results name only the CPU
        info = {"cpu": info}
    counts = [f"{info[k]} {k}" for k in ("cores", "threads") if info.get(k)]
    cpu = info["cpu"]
    if info.get("cpu_capability"):                     # which kernels ran: AVX512, AVX2, ...
        cpu += f" ({', '.join([info['cpu_capability'], *info.get('cpu_features', [])])})"
    label = " · ".join([cpu] + ([", ".join(counts)] if counts else []))
    if info.get("memory_gib"):
        label += f" · {info['memory_gib']:g} GiB"
    return label + (f" · {info['gpu']}" if info.get("gpu") else "")


def machine_caption(fig, info: dict | None = None, source: str = "measured live") -> None:
    """Name the machine under a figure, small and grey: every number in it came from there. The line is
    placed when the figure is drawn, just under everything else it draws (axis labels, tick labels,
    legends), wherever the layout put them: it never covers a label, and a notebook, which fits the image to
    what the figure holds, keeps it."""
    from matplotlib.text import Text

    class Caption(Text):
        def _place(self, renderer) -> None:
            boxes = [a.get_tightbbox(renderer) for a in fig.axes]
            boxes += [t.get_window_extent(renderer) for t in fig.texts if t is not self and t.get_visible()]
            boxes += [g.get_window_extent(renderer) for g in fig.legends]
            bottom = min((b.y0 for b in boxes if b is not None and b.height > 0), default=0.0)   # display units
            self.set_y(fig.transFigure.inverted().transform((0, bottom - 3))[1])   # 3 pixels under it

        def draw(self, renderer):
            self._place(renderer)
            super().draw(renderer)

        def get_window_extent(self, renderer=None, dpi=None):
            if renderer is not None:
                self._place(renderer)
            return super().get_window_extent(renderer, dpi)

    fig.add_artist(Caption(0.995, 0, f"{source}: {machine_label(info)}", ha="right", va="top", fontsize=7,
                           color="gray"))


def timed_on(model) -> str:
    """One line for a cell that times the model: which backend's kernels ran, on how many threads
    ('timed on backend torch (PyTorch's operators), 2 threads')."""
    from ..backends import describe

    lines = describe(model)
    said = lines[0] if len(lines) == 1 else lines[0] + " " + "; ".join(line.strip() for line in lines[1:])
    said = said.replace(": ", " (", 1) + ")" if len(lines) == 1 else said
    return f"timed on {said}, {torch.get_num_threads()} threads"


RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def load_result(name: str) -> dict | None:
    """A committed benchmark result, benchmarks/results/<name>.json, for a notebook to show beside its live
    numbers; None (and a line saying how to make it) when it is not there."""
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        print(f"no committed result {path.name}: run the script in benchmarks/ that writes it (see benchmarks/README.md)")
        return None
    return json.loads(path.read_text())


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


def load_transformers_peer(model_path=None):
    """Hugging Face transformers reading the same GGUF, float32: the engine most people would try first."""
    try:
        import transformers
    except ImportError:
        raise ValueError("--peer transformers needs transformers and accelerate: "
                         "pip install transformers accelerate") from None
    from ..weights import find_model

    path = find_model(model_path)
    kwargs = {} if path.is_dir() else {"gguf_file": path.name}
    folder = path if path.is_dir() else path.parent
    m = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kwargs)
    return m.eval().requires_grad_(False)


def peer_generate(hf_model, ids: list[int], max_tokens: int, stop_ids) -> Generation:
    """Greedy `generate()` with the KV cache on, timed token by token through a streamer."""
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):  # first call: the prompt; then one call per new token
            self.times.append(time.perf_counter())

        def end(self):
            pass

    clock = Clock()
    t0 = time.perf_counter()
    out = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, use_cache=True,
                            eos_token_id=sorted(stop_ids), pad_token_id=min(stop_ids), streamer=clock)
    new = out[0, len(ids):].tolist()
    stamps = [t0] + clock.times[1:]
    g = Generation(prompt_tokens=len(ids), stage="transformers")
    g.token_ids = [t for t in new if t not in stop_ids]
    g.token_times_s = [b - a for a, b in zip(stamps, stamps[1:])]
    g.ttft_s = g.token_times_s[0] if g.token_times_s else 0.0
    return g


def run_bench(model, tokenizer, stages: list[str], prompts: list[dict], max_tokens: int = 64,
              repeats: int = 1, peer=None, kv_cache_dtype: str | None = None) -> dict:
    """Each stage (and the peer, if given) on every prompt, taking turns; medians per stage.
    kv_cache_dtype: how the stages' caches store K/V (None: the model's dtype)."""
    params = SamplingParams(max_tokens=max_tokens)
    encoded = [prompt_ids(tokenizer, p) for p in prompts]
    names = stages + (["transformers"] if peer is not None else [])

    def run(name, ids, n):
        if name == "transformers":
            return peer_generate(peer, ids, n, tokenizer.stop_ids)
        return generate(model, tokenizer, ids, SamplingParams(max_tokens=n), name, kv_cache_dtype=kv_cache_dtype)

    for name in names:  # untimed: first calls pay for allocations and lazy init
        run(name, encoded[0], 4)
    runs = {s: [] for s in names}
    jobs = [(i, s) for _ in range(repeats) for i in range(len(encoded)) for s in names]
    for i, name in tqdm(jobs, desc="bench", disable=None):
        runs[name].append(run(name, encoded[i], params.max_tokens))
    results = []
    for name in names:
        gs = runs[name]
        results.append({
            "stage": name,
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
    if peer is not None:  # same greedy tokens? (a check on the comparison, not a test)
        for name in stages:
            r = next(r for r in results if r["stage"] == name)
            r["same_tokens_as_transformers"] = all(
                a.token_ids == b.token_ids for a, b in zip(runs[name], runs["transformers"]))
    read_bw = measure_read_bandwidth()
    wbytes = weight_bytes(model)
    for r in results:                   # of the tokens/s that reading every weight once per token allows
        if r["stage"] != "transformers":
            r["fraction_of_floor"] = r["decode_tokens_per_s"] * wbytes / read_bw
    info = machine_info()
    return {"machine": info["cpu"], "gpu": info["gpu"], "torch": info["torch"], "threads": info["threads"],
            "cores": info["cores"], "max_tokens": max_tokens, "repeats": repeats,
            "prompts": [p.get("name", p["prompt"][:30]) for p in prompts],
            "weight_bytes": wbytes, "read_bytes_per_s": read_bw,
            "bandwidth_floor_tokens_per_s": read_bw / wbytes,
            "results": results}
