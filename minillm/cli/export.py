"""`python -m minillm export DIR`: the model as a Hugging Face folder (minillm/export.py)."""
from __future__ import annotations


def cmd_export(args) -> None:
    from ..export import export

    out = export(args.dir, args.model, args.dtype)
    print(f"wrote {out}: load it with transformers (AutoModelForCausalLM, AutoTokenizer), or serve it with vLLM; "
          f"the weights and token ids are minillm's")
