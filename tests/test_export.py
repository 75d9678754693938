"""`python -m minillm export DIR`: transformers loads the folder, and its logits, greedy tokens, token ids and
chat template are minillm's."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minillm.generate import generate
from minillm.sampling import SamplingParams

CORPUS = Path(__file__).parent / "data" / "tokenizer_corpus.txt"
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "smollm2"
    r = subprocess.run([sys.executable, "-m", "minillm", "export", str(out)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "wrote" in r.stdout, r.stderr
    return out


@pytest.fixture(scope="module")
def hf_tokenizer(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(folder)


def test_the_folder_has_what_the_peers_load_and_minillm_reads_it_back(folder, model):
    import minillm

    assert {p.name for p in folder.iterdir()} == {"config.json", "generation_config.json", "model.safetensors",
                                                  "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    back = minillm.load_model(folder)
    ids = torch.arange(100, 140)[None]
    with torch.inference_mode():
        assert torch.equal(back(ids), model(ids))


def test_transformers_computes_minillms_logits_and_greedy_tokens(folder, model, tokenizer):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(CHAT)
    with torch.inference_mode():
        theirs, ours = hf(torch.tensor([ids])).logits[0], model(torch.tensor([ids]))[0]
        assert (theirs - ours).abs().max() < 1e-3
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
    ref = generate(model, tokenizer, ids, SamplingParams(max_tokens=24), stage="kv")
    stop = next((i for i, t in enumerate(greedy) if t in tokenizer.stop_ids), len(greedy))
    assert greedy[:stop] == ref.token_ids


def test_its_tokenizer_gives_minillms_ids_and_chat_template(hf_tokenizer, tokenizer):
    text = CORPUS.read_text(encoding="utf-8")
    assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text)
    for line in text.splitlines(keepends=True)[:200]:
        assert hf_tokenizer(line, add_special_tokens=False)["input_ids"] == tokenizer.encode(line), line
    ids = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert ids == tokenizer.apply_chat_template(CHAT)
    assert hf_tokenizer.decode(tokenizer.encode("Hello, 123 wörld!")) == "Hello, 123 wörld!"


def test_export_refuses_a_folder_with_files(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    r = subprocess.run([sys.executable, "-m", "minillm", "export", str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "not empty" in r.stderr and (tmp_path / "keep.txt").read_text() == "mine"
