"""A model's chat template: the Jinja program shipped with the model that turns messages into its prompt.

Every instruct model formats a conversation its own way (SmolLM2 and Qwen: ChatML's `<|im_start|>role`;
Llama 3: `<|start_header_id|>role<|end_header_id|>`), and a model answers well only in the format it was
trained on, so the template comes from the model's file (`tokenizer.chat_template` in GGUF,
`chat_template` in tokenizer_config.json) and is rendered as transformers renders it: a sandboxed
Jinja environment with trim_blocks and lstrip_blocks, loop controls, a `tojson` that keeps non-ASCII
text, and `raise_exception`, `strftime_now` and `namespace` for the template to call.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache


@lru_cache(maxsize=8)
def compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ValueError(f"the model's chat template is not valid Jinja (line {e.lineno}: {e.message})") from None


def render(source: str, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
           **special_tokens) -> str:
    """The prompt text for `messages` (dicts with 'role' and 'content'); special_tokens: bos_token=..., eos_token=...
    A template that refuses the conversation (e.g. roles that do not alternate) raises ValueError with its message."""
    import jinja2

    try:
        return compile_template(source).render(messages=messages, tools=tools, documents=None,
                                               add_generation_prompt=add_generation_prompt, **special_tokens)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the model's chat template refused these messages: {e}") from None
