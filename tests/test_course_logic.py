"""What the notebooks compute through minillm: floors and predictions, attention traffic, trace replays,
committed results, kernel sources. Small, exact cases; the notebooks show them at full size."""
import json
from pathlib import Path

import pytest
import torch

from minillm.course.traffic import attention_sizes, attention_traffic
from minillm.config import ModelConfig
from minillm.kv import BlockPool, OutOfBlocks
from minillm.course.reservation import (paged_utilization, predicted_paged_utilization, replay_concurrency,
                                    reserved_utilization, sequences_that_fit)

ROOT = Path(__file__).resolve().parent.parent
TRACE = [json.loads(line) for line in (ROOT / "data" / "request_trace.jsonl").read_text().splitlines()]


def test_attention_sizes_count_query_and_kv_heads_from_the_config():
    cfg = ModelConfig()                                            # 9 query heads, 3 KV heads, head dim 64
    sizes = attention_sizes(cfg, 1024, e=4)
    assert sizes["qkvo"] == (2 * 9 + 2 * 3) * 1024 * 64 * 4
    assert sizes["scores"] == 9 * 1024 * 1024 * 4


def test_flash_traffic_counts_each_visited_tile_once_per_query_block():
    cfg = ModelConfig(n_heads=1, n_kv_heads=1, head_dim=8)
    r = attention_traffic(cfg, T=128, e=1, block_m=64, block_n=64)
    # Q in + O out: 2 x 128 x 8; block 0 visits keys 0-63, block 1 keys 0-127: (64 + 128) x 2 (K, V) x 8
    assert r["flash"] == 2 * 128 * 8 + (64 + 128) * 2 * 8
    assert r["naive"] > 8 * 128 * 128                              # at least the 8 passes over the matrix
    big = attention_traffic(ModelConfig(), 16384, e=2, block_m=64, block_n=64)
    assert 7 < big["ratio"] < 8.2                                  # about 8 x BLOCK_M / D
    assert attention_traffic(ModelConfig(), 16384, block_m=128, block_n=64)["ratio"] > 1.9 * big["ratio"]


def test_reservation_utilization_by_formula():
    trace = [{"prompt_tokens": 10, "output_tokens": 4}]
    used = 10 + 11 + 12 + 13
    assert reserved_utilization(trace, "fixed", max_len=100) == used / (4 * 100)
    assert reserved_utilization(trace, "oracle") == used / (4 * 14)
    assert reserved_utilization(trace, "max_tokens", max_tokens=6) == used / (4 * 16)
    with pytest.raises(ValueError, match="policy must be one of"):
        reserved_utilization(trace, "greedy")


def test_paged_replay_matches_the_half_block_prediction():
    for bs in (8, 16, 64):
        assert paged_utilization(TRACE[:100], bs) == pytest.approx(predicted_paged_utilization(TRACE[:100], bs), abs=0.003)
    assert paged_utilization(TRACE[:100], 1) == 1.0


def test_what_fits_at_once():
    trace = [{"prompt_tokens": 30, "output_tokens": 10}] * 10        # 40 tokens each
    assert sequences_that_fit(trace, 100, "oracle") == 2
    assert sequences_that_fit(trace, 100, "paged_final", block_size=8) == 2   # 5 blocks each, 12 blocks
    assert sequences_that_fit(trace, 100, "fixed", max_len=50) == 2
    assert sequences_that_fit(trace[:1], 10**6, "oracle") == 1


def test_replay_finishes_every_request_and_paged_runs_more_at_once():
    budget = 4000
    trace = TRACE[:60]
    r = {p: replay_concurrency(trace, budget, p, block_size=16, max_len=4096) for p in ("oracle", "paged")}
    tokens = sum(t["output_tokens"] for t in trace)
    for policy, res in r.items():
        assert res["answer_tokens"] == tokens
        assert res["mean_running"] * res["steps"] >= tokens + res["regenerated_tokens"]   # paged: some twice
    assert r["oracle"]["preemptions"] == 0 and r["oracle"]["regenerated_tokens"] == 0
    assert r["paged"]["mean_running"] > r["oracle"]["mean_running"]
    with pytest.raises(ValueError, match="more than the budget"):
        replay_concurrency([{"prompt_tokens": 10, "output_tokens": 1}], 5, "oracle")


def test_paged_replay_agrees_with_the_engines_scheduler():
    """The replay's paged policy is a sketch of the engine's scheduler; on a small trace they agree closely."""
    from minillm.course.simulate import simulate

    trace, tokens = TRACE[:100], 6000
    cfg = ModelConfig(n_layers=1, d_model=8, n_heads=1, n_kv_heads=1, head_dim=8, ffn_dim=8, vocab_size=8)
    steps = simulate([t["prompt_tokens"] for t in trace], [t["output_tokens"] for t in trace], cfg=cfg,
                     kv_cache_memory=tokens * 2 * 8 * 4, max_num_seqs=256, max_num_batched_tokens=4096)
    replay = replay_concurrency(trace, tokens, "paged", block_size=16)
    assert abs(len(steps) - replay["steps"]) <= 0.05 * replay["steps"]


def test_bookkeeping_pool_has_no_tensors_but_the_same_rules():
    pool = BlockPool(None, num_blocks=4, block_size=4)
    assert pool.k is None
    pool.allocate(0, 6)
    pool.fork(0, 1)
    pool.grow(1, 1)                                                  # copy-on-write, without data to copy
    assert pool.tables[1][0] == pool.tables[0][0] and pool.tables[1][1] != pool.tables[0][1]
    assert pool.slots(0, 0, 6).tolist() == [pool.tables[0][i // 4] * 4 + i % 4 for i in range(6)]
    with pytest.raises(OutOfBlocks):
        pool.grow(0, 8)


def test_floors_and_predictions(model):
    from minillm.course.roofline import predict_kv_step_s, predict_naive_step_s, step_floors, weight_bytes

    bw, flops = 20e9, 200e9
    floors = step_floors(model, tokens=1, context=100, bandwidth=bw, flops=flops)
    assert floors["memory_s"] > weight_bytes(model) / bw and floors["memory_s"] > floors["compute_s"]
    assert predict_kv_step_s(model, 100, bw, flops) == floors["memory_s"]
    assert predict_naive_step_s(model, 1000, bw, flops) > 10 * predict_kv_step_s(model, 1000, bw, flops)


def test_matvec_bandwidth_and_profile(model):
    from minillm.course.timing import profile_ops
    from minillm.course.roofline import measure_matvec_bandwidth

    assert measure_matvec_bandwidth(model, rows=1, repeats=2) > 1e8
    calls = []
    fn = lambda x, w: calls.append(1) or torch.nn.functional.linear(x, w)      # noqa: E731
    measure_matvec_bandwidth(model, rows=2, repeats=1, fn=fn)
    assert len(calls) == 3 * (4 * model.cfg.n_layers + 1)           # warm-up 2 + 1 timed, every weight
    ops = profile_ops(lambda: torch.ones(64, 64) @ torch.ones(64, 64), repeats=2, warmup=1)
    assert any(r["op"] == "aten::mm" and r["calls"] == 1 for r in ops)


def test_committed_results_and_kernel_sources(capsys):
    from minillm.course.bench import load_result
    from minillm.triton_support import kernel_source

    assert load_result("cpu_kernel_checks")["same_tokens_as_naive"] == {"flash": True, "paged": True}
    assert load_result("no_such_result") is None
    assert "benchmarks/" in capsys.readouterr().out
    src = kernel_source("attention/triton_flash.py", "_online_softmax_step")
    assert src.startswith("@triton.jit\ndef _online_softmax_step(") and "exp2" in src
    with pytest.raises(ValueError, match="no function"):
        kernel_source("attention/triton_flash.py", "nope")


def test_speculative_speedup_predicted_from_a_runs_counters():
    from minillm.course.speculative_bench import predicted_run_speedup

    costs = {"1": 0.05, "2": 0.05, "5": 0.10}           # two tokens cost one step; five cost two steps
    plain = {"tokens": 101, "spec_drafts": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0, "system": "kv"}
    assert predicted_run_speedup(plain, costs, {}) == 1.0
    # 100 tokens after the first in 20 passes of 4 drafts (width 5, 2 steps each), all accepted: 100 / 40
    lookup = {"tokens": 101, "spec_drafts": 20, "spec_draft_tokens": 80, "spec_accepted_tokens": 80, "system": "ngram"}
    assert predicted_run_speedup(lookup, costs, {}) == pytest.approx(2.5)
    # the same with a draft that costs 0.5 steps per drafted token: 100 / (40 + 40)
    layers = dict(lookup, system="layers:15")
    assert predicted_run_speedup(layers, costs, {"15": 0.5}) == pytest.approx(1.25)
    # one draft per pass, always rejected: 100 passes of width 2 (one step each), no gain
    wrong = {"tokens": 101, "spec_drafts": 100, "spec_draft_tokens": 100, "spec_accepted_tokens": 0, "system": "ngram"}
    assert predicted_run_speedup(wrong, costs, {}) == pytest.approx(1.0)


def test_step_split_accounts_for_the_wall_time_in_four_parts(tokenizer):
    """A tiny model's paged engine step: matrix products, attention (SDPA over gathered pages), the other
    operators and Python add up to the step's wall time, and each of the first three is seen."""
    from test_paged_torch import tiny_model

    from minillm.course.step_profile import _category, bytes_per_token, step_split
    from minillm.engine import LLMEngine
    from minillm.sampling import SamplingParams

    model = tiny_model()
    engine = LLMEngine(model, tokenizer, block_size=4, num_blocks=64, attention="torch", verbose=False)
    for i in range(3):
        engine.add_request(str(i), list(range(1, 10 + i)), SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    split = step_split(engine.step, repeats=3, warmup=1)
    parts = [split[k] for k in ("matmul_ms", "attention_ms", "other_ms", "python_ms")]
    assert all(p > 0 for p in parts[:3]) and parts[3] >= 0, split
    assert sum(parts) == pytest.approx(split["wall_ms"], rel=1e-6)
    assert split["ops_per_step"] > 10 and split["top"]
    assert bytes_per_token(model, 0) == sum(t.numel() * t.element_size() for t in model.state_dict().values())

    class Event:                                              # the categories, by an operator and its callers
        def __init__(self, name, parent=None):
            self.name, self.cpu_parent = name, parent
    sdpa = Event("aten::scaled_dot_product_attention")
    assert _category(Event("aten::bmm", sdpa)) == "attention"
    assert _category(Event("aten::mm", Event("aten::linear"))) == "matmul"
    assert _category(Event("aten::_weight_int4pack_mm_for_cpu")) == "matmul"
    assert _category(Event("aten::index_select", Event("aten::embedding"))) == "other"
    assert _category(Event("aten::index_select")) == "attention"
    assert _category(Event("aten::mul")) == "other"


def test_textbook_operators_give_the_same_logits_with_more_calls():
    """notebook 14's before / after: the step's textbook operators (RoPE by concatenation, q/k/v by slicing,
    whole-cache indexing) compute the same logits bit for bit, call more operators, and are put back after."""
    from test_paged_torch import tiny_model

    from minillm import model as model_module
    from minillm.course.step_variants import VARIANTS, op_counts, textbook
    from minillm.stages import KVCacheRunner

    model = tiny_model()
    runner = KVCacheRunner(model, max_len=32)

    def run():                                                # a prompt, then two decode steps
        return torch.stack([runner.prefill([5, 9, 2, 7]), runner.decode(11), runner.decode(3)])
    with textbook():                                          # as written, the block in PyTorch
        after, after_ops = run(), sum(op_counts(lambda: runner.decode(4)).values())
    saved = (model_module.apply_rope, model_module.rope_tables, model_module.Attention.qkv)
    for parts in [(v,) for v in VARIANTS] + [VARIANTS]:
        with textbook(*parts):
            assert torch.equal(run(), after), parts
            before_ops = sum(op_counts(lambda: runner.decode(4)).values())
        assert before_ops > after_ops, parts
    assert (model_module.apply_rope, model_module.rope_tables, model_module.Attention.qkv) == saved
    with pytest.raises(ValueError, match="unknown variants"):
        with textbook("fusion"):
            pass


def test_versus_words_follow_the_numbers():
    from minillm.course.prose import versus

    assert versus(2.1, 1.0) == "2.1× higher than"
    assert versus(1.0, 1.3) == "1.3× lower than"
    assert versus(1.03, 1.0) == "within 5% of"
    assert versus(1.0, 1.2, within=0.25) == "within 25% of"
    with pytest.raises(ValueError, match="positive"):
        versus(0.0, 1.0)


def test_prediction_checks_pass_a_right_sized_number_and_fail_a_wrong_one(capsys):
    from minillm.course.exercises.predict import check_prediction, check_ridge_batch, ridge_batch

    assert check_prediction(lambda x: 2 * x, {"x": 3.0}, 5.0, what="a step", factor=2)
    assert not check_prediction(lambda x: 20 * x, {"x": 3.0}, 5.0, what="a step")
    assert not check_prediction(lambda x: -x, {"x": 3.0}, 5.0, what="a step")

    def unwritten(x):
        raise NotImplementedError
    assert not check_prediction(unwritten, {"x": 3.0}, 5.0, what="a step")
    assert "not written yet" in capsys.readouterr().out
    measured = []                      # a measurement is made only after the learner's function answered
    assert check_prediction(lambda x: 2 * x, {"x": 3.0}, lambda: measured.append(1) or 6.5, what="a step")
    assert measured == [1]
    assert not check_prediction(unwritten, {"x": 3.0}, lambda: measured.append(2) or 6.0, what="a step")
    assert measured == [1]
    assert not check_prediction(lambda x: 2 * x, {"x": 3.0}, 8.0, what="a step")   # 0.75x: outside 1.3x
    assert ridge_batch(989e12, 4.8e12, 2) == pytest.approx(206.0, rel=0.01)
    assert check_ridge_batch(ridge_batch, 100e9, 20e9)
    assert not check_ridge_batch(lambda p, bw, b: p / bw, 100e9, 20e9)


def test_run_times_and_their_spread_in_words():
    from minillm.course.timing import median_time, run_times, spread

    calls = []
    times = run_times(lambda: calls.append(1), repeats=4, warmup=2)
    assert len(times) == 4 and len(calls) == 6 and all(t >= 0 for t in times)
    assert median_time(lambda: None, repeats=3) >= 0
    assert spread([0.010, 0.012, 0.020]) == "12.0 ms (10.0-20.0 over 3 runs)"


def test_step_timers_give_every_repeat_and_their_median(tokenizer):
    """07 and 08 print a step's cost with its range, so the timers hand back each repeat, not only the median."""
    import statistics

    from test_paged_torch import tiny_model

    from minillm.course.simulate import decode_step_seconds, decode_step_times, prefill_step_times

    model = tiny_model(vocab_size=49152)            # the timers' prompts use token ids up to 1,500
    decode = decode_step_times(model, tokenizer, batch=2, context=5, steps=4)
    prefill = prefill_step_times(model, tokenizer, tokens=7, repeats=3)
    assert len(decode) == 4 and len(prefill) == 3 and all(t > 0 for t in decode + prefill)
    assert decode_step_seconds(model, tokenizer, batch=2, context=5, steps=3) > 0
    assert statistics.median(prefill) > 0


def test_machine_caption_sits_under_every_label_and_is_kept():
    """The caption that names the machine is placed when the figure is drawn, under the axis labels and a
    figure legend, wherever the layout put them, and inside the image a notebook saves (a tight box)."""
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from minillm.course.bench import machine_caption

    fig, axes = plt.subplots(1, 2, figsize=(6, 2.5))
    axes[0].plot([1, 2]); axes[0].set_xlabel("tokens in the pass (k + 1)")
    machine_caption(fig, {"cpu": "Test CPU", "cpu_capability": "AVX2", "cores": 2, "threads": 2, "memory_gib": 8})
    fig.tight_layout()                                      # after the caption, as many notebook cells do
    fig.savefig(io.BytesIO(), bbox_inches="tight")          # draws it
    renderer = fig.canvas.get_renderer()
    caption = next(a for a in fig.artists if "Test CPU" in a.get_text())
    label = axes[0].xaxis.label.get_window_extent(renderer)
    assert caption.get_window_extent(renderer).y1 <= label.y0
    plt.close(fig)
