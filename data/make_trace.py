"""Writes data/request_trace.jsonl: 500 synthetic chat requests (prompt and output lengths in tokens).

Lengths are log-normal, as request lengths in public chat logs tend to be: most requests are short,
a few are very long. Medians 180 (prompt) and 140 (output) tokens, clipped to 8..3000 and 4..1500;
every request fits a 4,096-token context. Seeded, so the file is reproducible:

    python data/make_trace.py
"""
import json
from pathlib import Path

import numpy as np

rng = np.random.default_rng(2026)
n = 500
prompt = np.clip(rng.lognormal(np.log(180), 0.9, n), 8, 3000).astype(int)
output = np.clip(rng.lognormal(np.log(140), 0.8, n), 4, 1500).astype(int)
output = np.minimum(output, 4096 - prompt)
with open(Path(__file__).parent / "request_trace.jsonl", "w") as f:
    for i, (p, o) in enumerate(zip(prompt, output)):
        f.write(json.dumps({"id": i, "prompt_tokens": int(p), "output_tokens": int(o)}) + "\n")
