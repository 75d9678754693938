"""The notebooks' view of the committed GPU run: every table prints, labelled as a GPU result, and a missing
run or a failed part says so instead of raising."""
import json

from minillm.course import gpu_results as g

SHOWS = [g.show_prefill, g.show_decode, g.show_paged, g.show_serving, g.show_chunk_budget, g.show_speculation,
         g.show_quantized]


def test_every_table_of_the_committed_run_prints_and_names_the_gpu(capsys):
    run = g.gpu_run()
    assert run is not None, "benchmarks/results/gpu_h200.json is committed"
    for show in SHOWS:
        show(run)
        out = capsys.readouterr().out
        assert out.startswith("committed GPU run: NVIDIA"), (show.__name__, out[:200])
        assert "has no" not in out, (show.__name__, out)


def test_no_run_and_a_failed_part_are_said_not_raised(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(g, "RESULTS", tmp_path)
    (tmp_path / "gpu_cpu.json").write_text(json.dumps({"dry_run": True, "device_check": {}, "parts": {}}))
    assert g.gpu_run() is None
    assert "python benchmarks/gpu.py" in capsys.readouterr().out
    run = {"device_check": {"gpu": "X", "sms": 1, "machine": {"torch": "t"}},
           "parts": {"prefill": {"error": "RuntimeError: planted"}}}
    assert g.show_prefill(run) is None and g.show_decode(run) is None
    out = capsys.readouterr().out
    assert "'prefill' results: RuntimeError: planted" in out and "no 'decode' results" in out
