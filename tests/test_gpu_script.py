"""benchmarks/gpu.py, the one script that checks and measures the GPU path, run dry here: its device check,
its parts at small sizes on the CPU (Triton interpreted, a small random model), and its error recording."""
import pytest
import torch

from helpers.benchmark_script import load_benchmark

pytestmark = pytest.mark.triton


@pytest.fixture(scope="module")
def gpu_script():
    return load_benchmark("gpu")


def test_a_dry_run_checks_every_part_against_its_reference(gpu_script, monkeypatch):
    def broken(ctx):
        raise RuntimeError("planted")

    monkeypatch.setitem(gpu_script.RUNNERS, "broken", broken)
    parts = ["kernels", "prefill", "decode", "paged", "single_stream", "serving", "quantized", "flips", "broken"]
    saved = []
    report = gpu_script.run(parts, torch.device("cpu"), dry=True, save=lambda r: saved.append(list(r["parts"])))
    assert report["device_check"]["ok"] and report["device_check"]["triton_interpreted"]
    p = report["parts"]
    assert p["broken"]["error"] == "RuntimeError: planted"                  # recorded, and the rest ran
    assert not any("error" in p[name] for name in parts[:-1]), {k: v.get("error") for k, v in p.items()}
    assert p["kernels"]["all_within_tolerance"]
    assert all(r["rel_error"] < 1e-5 for r in p["decode"]["rows"])
    assert all(r["rel_diff_paged_vs_contiguous"] < 1e-5 for r in p["paged"]["rows"])
    assert p["single_stream"]["same_tokens"] and not p["single_stream"]["graphs_captured"]   # no graphs on a CPU
    assert p["serving"]["4_requests"]["continuous"]["completed"] == 4
    assert p["quantized"]["int8"]["kl"] < p["quantized"]["q4"]["kl"] < 0.1
    assert all(r["naive_ms"] > 0 and r["rel_error_vs_sdpa"] < 1e-5 for r in p["prefill"]["rows"])
    assert all(r["completed"] == 4 for r in p["flips"]["chunk_budget"].values())
    assert p["flips"]["speculative"]["ngram"]["same_tokens"]
    # written after the device check and after every part: a run stopped part-way keeps what it measured
    assert saved == [[]] + [parts[:i + 1] for i in range(len(parts))]


def test_nothing_runs_on_a_device_that_computes_wrong(gpu_script, monkeypatch):
    def wrong(ctx):
        raise RuntimeError("the device does not compute what the CPU does")

    monkeypatch.setattr(gpu_script, "check_device", wrong)
    report = gpu_script.run(["decode"], torch.device("cpu"), dry=True)
    assert not report["device_check"]["ok"] and report["parts"] == {}


def test_without_a_gpu_it_asks_for_a_dry_run(gpu_script, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit):
        gpu_script.main([])
    assert "--dry-run" in capsys.readouterr().err
