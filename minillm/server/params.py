"""What a request's body asks for, checked and turned into the engine's terms: the tools offered and which
may be called (`tools_offered`), the grammar an answer must follow (`answer_grammar`: response_format's JSON
or tool calls), sizes refused before any text is tokenized (`check_sizes`), and the SamplingParams
(`sampling_params`). Every refusal is an APIError naming the field to fix."""
from __future__ import annotations

import json
from dataclasses import dataclass

from .. import structured
from ..sampling import ParamError, SamplingParams, check_vocab
from . import tools as tool_calls
from .protocol import APIError


@dataclass(frozen=True)
class Limits:
    """What a model's engine allows a request."""
    max_num_seqs: int            # sequences at once (each choice is one)
    max_len: int                 # the context, prompt and answer
    max_token_bytes: int         # the most bytes of text one token covers
    vocab_size: int
    max_tokens_default: int      # tokens an answer without max_tokens may have


def tools_offered(body) -> tuple[list[dict] | None, str | None]:
    """The functions offered, and which may be called: "auto", "required", a function's name, or None."""
    tools = [t.function.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise APIError(400, "'tool_choice' needs 'tools': give the functions the model may call", "tool_choice")
    if tools and len({t["name"] for t in tools}) != len(tools):
        raise APIError(400, "two tools have the same name: each function needs its own", "tools")
    if not tools or choice == "none":
        return tools, None
    return tools, choice.function.name if hasattr(choice, "function") else choice or "auto"

def answer_grammar(body, tools=None, choice=None) -> str | None:
    """The grammar of the answer: response_format's JSON, tool calls (text or JSON beside them under
    "auto"), or None for free text."""
    rf = body.response_format
    schema = None
    if rf is not None and rf.type == "json_object":
        schema = {"type": "object"}
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise APIError(400, "response_format 'json_schema' needs 'json_schema': {'name', 'schema'}",
                           "response_format")
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {"type": "object"}
    try:
        if choice is not None:
            if schema is not None:
                structured.json_schema_grammar(schema)            # a clear error for a bad text schema
            text = None if schema is None else \
                "%json " + json.dumps({"x-guidance": tool_calls._COMPACT, **schema})
            return tool_calls.tools_grammar(tools, choice, body.parallel_tool_calls, text)
        return None if schema is None else structured.json_schema_grammar(schema)
    except ValueError as e:
        raise APIError(400, str(e), "tools" if choice is not None else "response_format") from None

def check_sizes(limits: Limits, body, num_prompts: int, texts: list[str], param: str) -> None:
    """What can be refused before any text is tokenized: too many sequences, and a text too long for the
    context whatever its tokens (a token covers at most max_token_bytes bytes)."""
    most = limits.max_num_seqs
    if not 1 <= body.n * num_prompts <= most:       # every choice is a sequence of its own
        raise APIError(400, f"'n' x prompts must be in [1, {most}] (the sequences the server runs at once); "
                            f"got n={body.n} for {num_prompts} prompt(s)", "n")
    limit, per_token = limits.max_len, limits.max_token_bytes
    for text in texts:
        size = len(text.encode("utf-8", errors="replace"))
        if size > (limit - 1) * per_token:
            raise APIError(400, f"this model's context is {limit} tokens and the {param} has {size} bytes of "
                                f"text, at least {-(-size // per_token)} tokens (a token covers at most "
                                f"{per_token} bytes); shorten it", param, "context_length_exceeded")

def sampling_params(limits: Limits, body, prompt_len: int, chat: bool, grammar: str | None = None) -> SamplingParams:
    max_tokens = body.max_completion_tokens if chat and body.max_completion_tokens is not None else body.max_tokens
    limit = limits.max_len
    if prompt_len >= limit:
        raise APIError(400, f"this model's context is {limit} tokens and the prompt has {prompt_len}; "
                            f"shorten it to at most {limit - 1}", "messages" if chat else "prompt",
                       "context_length_exceeded")
    if max_tokens is not None and max_tokens >= 1 and prompt_len + max_tokens > limit:
        raise APIError(400, f"this model's context is {limit} tokens: the prompt has {prompt_len} and max_tokens "
                            f"asks for {max_tokens} more; lower max_tokens to at most {limit - prompt_len} or "
                            f"shorten the prompt", "max_tokens", "context_length_exceeded")
    echo = not chat and body.echo
    if max_tokens == 0 and not echo:
        raise APIError(400, "'max_tokens' must be an integer >= 1 (0 only with 'echo': true, to score the "
                            "prompt)", "max_tokens")
    if max_tokens == 0 and body.n != 1:
        raise APIError(400, "scoring a prompt (max_tokens 0) has one answer: 'n' must be 1", "n")
    logprobs = prompt_logprobs = None
    if chat and body.logprobs:
        logprobs = body.top_logprobs or 0
    elif chat and body.top_logprobs is not None:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
    elif not chat:
        logprobs = body.logprobs
        prompt_logprobs = body.logprobs if echo and body.logprobs is not None else (0 if max_tokens == 0 else None)
    if body.temperature > 2:
        raise APIError(400, f"'temperature' must be in [0, 2]; got {body.temperature}", "temperature")
    keys = list(body.logit_bias or {})
    if not all(k.isascii() and k.isdigit() for k in keys):     # "7", not " 7", "1_0" or "٣" (int() takes those)
        raise APIError(400, f"'logit_bias' maps token ids to biases: its keys must be token ids written in the "
                            f"digits 0-9 (as strings); got {[k for k in keys if not (k.isascii() and k.isdigit())][:5]}",
                       "logit_bias")
    bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
    try:
        params = SamplingParams(
            temperature=body.temperature, top_p=body.top_p, top_k=max(body.top_k, 0), min_p=body.min_p,
            max_tokens=min(limit - prompt_len, limits.max_tokens_default) if max_tokens is None else max_tokens,
            stop=body.stop or (),
            seed=body.seed, ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, logit_bias=bias, grammar=grammar)
        check_vocab(params, limits.vocab_size)
        return params
    except ParamError as e:
        msg, param = str(e), e.param
        if param in ("logprobs", "prompt_logprobs"):          # the API's own names for them
            api = "top_logprobs" if chat else "logprobs"
            msg, param = api + msg.removeprefix(param), api
        raise APIError(400, msg, param) from None
