"""Tensor parallelism on torch.distributed (gloo, processes on this CPU): the same tokens as one process,
and a rank that fails, dies or never joins ends the run with a message within a bounded time."""
import json
import os
import subprocess
import sys
import time

import pytest
import torch
from helpers import ranks

from minillm.config import ModelConfig
from minillm.distributed import check_tensor_parallel
from minillm.distributed.launch import free_port, init_rank, run_ranks, tensor_parallel_generate
from minillm.generate import generate
from minillm.sampling import SamplingParams


def test_sizes_that_do_not_divide_are_refused_with_the_ones_that_do():
    check_tensor_parallel(ModelConfig(), 3)
    with pytest.raises(ValueError, match=r"query heads \(9\), KV heads \(3\).*one of \[1, 3\]"):
        check_tensor_parallel(ModelConfig(), 2)


@pytest.mark.parametrize("world", [1, 3])
def test_tensor_parallel_gives_the_kv_stages_tokens(model, tokenizer, world):
    ids = tokenizer.encode("The capital of France is")
    params = SamplingParams(max_tokens=12)
    out = tensor_parallel_generate(ids, params, world, with_logits=True, timeout_s=240)
    assert out["token_ids"] == generate(model, tokenizer, ids, params, stage="kv").token_ids
    with torch.inference_mode():
        ref = model(torch.tensor([ids]))[0, -1]                          # (vocab,)
    diff = (torch.from_numpy(out["prompt_logits"]) - ref).abs().max() / ref.abs().max()
    assert diff < 1e-5, f"logits differ by {diff:.2e} of their largest value"


def test_the_engine_split_across_ranks_gives_the_single_engines_outputs(model, tokenizer):
    """Rank 0 schedules (chunked prefill, two samples per prompt sharing blocks: copy-on-write), every rank
    runs each step on its shard with a pool of its own."""
    from minillm.distributed.launch import tensor_parallel_engine_generate
    from minillm.engine import LLMEngine

    prompts = [tokenizer.encode("Once upon a time, in a land far away, there lived a king"),
               tokenizer.encode("The capital of France is")]
    params, options = SamplingParams(max_tokens=10, ignore_eos=True), {"max_num_batched_tokens": 8}
    out = tensor_parallel_engine_generate(prompts, params, 3, options, n=2, timeout_s=240)
    engine = LLMEngine(model, tokenizer, verbose=False, kv_cache_memory=64 << 20, **options)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, n=2)
    single = {}
    while engine.has_unfinished_requests():
        single |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    assert [o["token_ids"] for o in out] == [single[k] for k in ("0", "0/1", "1", "1/1")]


def test_an_engine_step_survives_packing_for_the_followers():
    from minillm.distributed.leader import pack_step, unpack_step

    step = ([5, 6, 7, 8], [0, 1, 2, 9], [[3, 1], [0, 4, 2]], [3, 1], [3, 10], [2, 3], None, [(4, 7, 5)])
    assert unpack_step(pack_step(*step)) == step
    assert unpack_step(pack_step(*step[:6], 24, []))[6:] == (24, [])


def test_what_a_token_sends_is_counted_against_the_weights_it_reads(model):
    from minillm.course.parallel_costs import communication_bytes
    from minillm.course.roofline import weight_bytes

    c = communication_bytes(model.cfg, 3)
    assert c["weight_bytes_per_rank"] * 3 == weight_bytes(model)
    assert c["collectives"] == 2 * 30 + 2                             # per block 2, the embedding, the logits
    assert c["sent_per_rank"] == round((2 * 61 * 576 * 4 + 49152 * 4) * 2 / 3)
    assert communication_bytes(model.cfg, 1)["sent_per_rank"] == 0


def test_ranks_meet_in_a_collective():
    assert run_ranks(ranks.sum_of_ranks, 3, timeout_s=60) == 0 + 1 + 2


def test_a_failing_rank_ends_the_run_with_its_message():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed: ValueError: rank 1 was told to fail"):
        run_ranks(ranks.rank_one_raises, 2, timeout_s=60, join_timeout_s=30)
    assert time.monotonic() - t0 < 40


def test_a_rank_that_dies_ends_the_run():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 died \(exit code 3\)"):
        run_ranks(ranks.rank_one_dies, 2, timeout_s=60, join_timeout_s=30)
    assert time.monotonic() - t0 < 40


def test_a_rank_that_never_joins_is_reported_after_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 of 2: the other ranks did not all join within 2 s"):
        init_rank(0, 2, free_port(), timeout_s=2)
    assert time.monotonic() - t0 < 15


def test_kv_blocks_move_between_pools_and_land_in_free_blocks():
    stats = run_ranks(ranks.kv_send_then_receive, 2, timeout_s=60)
    assert stats["bytes"] == 2 * 2 * 3 * 4 * 1 * 8 * 4          # K and V, 2 layers, 3 blocks of 4, 1 head of 8, float32


def test_a_transfer_into_a_full_pool_fails_cleanly_and_the_next_one_arrives():
    failed = run_ranks(ranks.kv_send_into_a_full_pool, 2, timeout_s=60)
    assert failed.startswith("no room for the K/V of sequence 7 (10 tokens)") and "recomputed" in failed


def test_a_transfer_that_breaks_off_frees_its_blocks_and_says_so(tmp_path):
    report = tmp_path / "receiver.txt"
    with pytest.raises(RuntimeError, match="rank 1 of 2 died"):
        run_ranks(ranks.kv_sender_dies_midway, 2, str(report), timeout_s=60, join_timeout_s=10)
    assert report.read_text().startswith("freed: K/V of sequence 7 from rank 1 broke off after 0 bytes")


def test_disaggregated_prefill_and_decode_give_the_single_engines_outputs(model, tokenizer):
    from minillm.course.disaggregation import transfer_bytes
    from minillm.distributed.disaggregated import disaggregated_generate
    from minillm.engine import LLM

    texts = ["The capital of France is",
             "Once upon a time, in a land far away, there lived a king who had three daughters. The youngest",
             "Water boils at 100 degrees Celsius at sea level. At the top of a high mountain it boils at"]
    prompts = [tokenizer.encode(t) for t in texts]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    single = [o.token_ids for o in LLM(model, tokenizer, verbose=False).generate(prompts, params, use_tqdm=False)]
    out = disaggregated_generate(prompts, params, break_at=1, overlap=False, timeout_s=240)   # 1's transfer breaks off
    assert [o["token_ids"] for o in out] == single
    full = [(len(p) - 1) // 16 for p in prompts]                    # blocks a request can take from a cache
    assert [o["blocks"] for o in out] == [full[0], 0, full[2]] and full[2] > 0
    assert out[2]["num_cached_tokens"] == 16 * full[2] and out[2]["bytes"] == transfer_bytes(model.cfg, len(prompts[2]))
    assert out[1]["failed"].startswith("the prefill worker broke off") and out[1]["num_cached_tokens"] == 0
    assert [o["blocks_cached"] for o in out] == [full[0], full[0], full[0] + full[2]]   # exactly what arrived


def test_the_decode_worker_decodes_while_prompts_arrive(model, tokenizer):
    """Overlapped: blocks are taken between decode steps, and the outputs are still the single engine's."""
    from minillm.course.disaggregation import colocated_run
    from minillm.distributed.disaggregated import disaggregated_run

    prompts = [tokenizer.encode("The capital of France is"), list(range(1000, 1100)), list(range(2000, 2150))]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    run = disaggregated_run(prompts, params, timeout_s=240)
    single = colocated_run(prompts, params, model=model, tokenizer=tokenizer)
    assert [r["token_ids"] for r in run["requests"]] == [r["token_ids"] for r in single["requests"]]
    last_arrival = run["requests"][2]["span"][0]
    assert any(start < last_arrival for start, *_ in run["steps"]), "no decode step before the last prompt arrived"
    assert [r["num_cached_tokens"] for r in run["requests"]] == [0, 96, 144]
    assert all(r["ttft_s"] > 0 and len(r["itl_s"]) == 11 for r in run["requests"])
    assert [e[:2] for e in run["prefill"]] == [(k, i) for i in range(3) for k in ("prefill", "send")]


def test_torchrun_starts_the_same_run_the_standard_way(model, tokenizer):
    """torchrun --nproc-per-node 3 -m minillm generate ... --tensor-parallel 3: rank 0 prints, the others follow."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "minillm", "generate", "The capital of France is",
           "--max-tokens", "8", "--tensor-parallel", "3", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    causes = [line for line in r.stderr.splitlines()               # the ranks' own words, before torchrun's summary
              if any(w in line for w in ("terminate", "what()", "Error", "error", "Abort", "Signal"))]
    assert r.returncode == 0, "\n".join(causes[:40])
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, r.stdout                                      # only rank 0 speaks
    ids = tokenizer.encode("The capital of France is")
    assert lines[0]["token_ids"] == generate(model, tokenizer, ids, SamplingParams(max_tokens=8), stage="kv").token_ids
