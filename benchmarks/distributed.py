"""What crossing processes costs on this machine (torch.distributed, gloo over loopback):

- moving a prompt's KV cache from one worker to another (disaggregated prefill/decode), per prompt length;
- decode speed of the kv stage with the model split across 1 and 3 processes (tensor parallelism), and
  the latency of one all-reduce of a (1, 576) activation row (62 of them per token when split).

    python benchmarks/distributed.py          # writes benchmarks/results/cpu_distributed.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import minillm  # noqa: E402
from minillm.course.bench import machine_info, provenance  # noqa: E402
from minillm.distributed.kv_transfer import transfer_costs  # noqa: E402
from minillm.distributed.launch import run_ranks, tensor_parallel_generate  # noqa: E402
from minillm.course.parallel_costs import all_reduce_seconds  # noqa: E402
from minillm.sampling import SamplingParams  # noqa: E402


def main() -> None:
    lengths = [128, 512, 2048]
    transfer = run_ranks(transfer_costs, 2, lengths, 5, timeout_s=600)
    for n, r in transfer.items():
        print(f"KV of a {n:5d}-token prompt: {r['bytes'] / 2**20:6.1f} MiB in {r['seconds'] * 1e3:7.1f} ms "
              f"({r['bytes'] / r['seconds'] / 1e9:.2f} GB/s)")
    tok = minillm.load_tokenizer()
    ids = tok.encode("Once upon a time, in a land far away, there lived a")
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    tp = {}
    for world in (1, 3, 1, 3):                                   # alternated: the machine's drift hits both
        out = tensor_parallel_generate(ids, params, world)
        tp.setdefault(world, []).append(out["decode_tokens_per_s"])
        print(f"tensor parallel {world}: {out['decode_tokens_per_s']:.1f} tok/s decode")
    latency = {}
    for world in (2, 3, 2, 3):
        latency.setdefault(world, []).append(run_ranks(all_reduce_seconds, world, 576, 200, timeout_s=300))
        print(f"all-reduce of 576 floats across {world} processes: {latency[world][-1] * 1e6:.0f} µs (median of 200)")
    result = {"machine": machine_info(), **provenance(), "kv_transfer": {str(n): r for n, r in transfer.items()},
              "tensor_parallel_decode_tokens_per_s": {str(w): v for w, v in tp.items()},
              "all_reduce_576_floats_seconds": {str(w): v for w, v in latency.items()},
              "note": "each rank runs 1 torch thread; gloo over loopback TCP"}
    path = Path(__file__).resolve().parent / "results" / "cpu_distributed.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
