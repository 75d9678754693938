"""The OpenAI API's request bodies (the fields minillm serves) and its error shape.

Bodies are validated strictly: a field of the wrong type, or one the API does not have, is a 400
that names it. Structured output (response_format) and tools (tools, tool_choice, parallel_tool_calls,
tool messages) are OpenAI's shapes; tools.py says how they reach the model. `null` for an optional field means its default, as in OpenAI's API. Values are
checked where the engine checks them (SamplingParams), so the messages are the same in Python, on
the command line and over HTTP. Extensions beyond OpenAI's fields, as vLLM has them: top_k, min_p,
repetition_penalty, ignore_eos, stream_options.continuous_usage_stats, and the /tokenize and
/detokenize bodies.
"""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import models_json_schema


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # OpenAI's fields this server cannot act on: {field: (the values it can honour, what to send instead)}.
    # null (or one of those values) means the default; any other value is a 400 that names the field.
    honoured: ClassVar[dict[str, tuple[tuple, str]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data):
        """OpenAI reads null as "not given": drop it for optional fields (unknown fields stay, refused)."""
        if isinstance(data, dict):
            fields = cls.model_fields
            return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}
        return data

    @field_validator("*")
    @classmethod
    def _honourable(cls, value, info):
        rule = cls.honoured.get(info.field_name)
        if rule is not None and value not in rule[0]:
            raise ValueError(rule[1])
        return value


def _range(default, **bounds):
    """A field's allowed range, written into the OpenAPI schema for clients and fuzzers to read; the engine's
    SamplingParams checks it (the same message in Python, on the command line and over HTTP)."""
    return Field(default, json_schema_extra=bounds)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False         # extension (vLLM): usage so far in every chunk


class JsonSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")   # None: any JSON object
    strict: bool | None = None                    # accepted: the answer always follows the schema here


class ResponseFormat(_Body):
    """{"type": "text"}, {"type": "json_object"} (any JSON object), or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}: the answer is JSON that validates against the schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Body):
    model: str
    max_tokens: int | None = _range(None, minimum=0)
    temperature: float = _range(1.0, minimum=0, maximum=2)     # OpenAI's default; 0 is greedy
    top_p: float = _range(1.0, exclusiveMinimum=0, maximum=1)
    top_k: int = _range(0, minimum=-1)           # extension: 0 (or -1) is off
    min_p: float = _range(0.0, minimum=0, maximum=1)           # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = _range(1, minimum=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False                     # extension: keep going past end-of-text (benchmarks)
    frequency_penalty: float = _range(0.0, minimum=-2, maximum=2)
    presence_penalty: float = _range(0.0, minimum=-2, maximum=2)
    repetition_penalty: float = _range(1.0, exclusiveMinimum=0, maximum=10)     # extension
    logit_bias: dict[str, float] | None = None   # token id (as a string) -> bias in [-100, 100]
    user: str | None = None                      # accepted, not used
    response_format: ResponseFormat | None = None
    # OpenAI's fields that SDKs send (often as null): honoured where they ask for what happens anyway
    store: bool | None = None
    metadata: dict | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None         # accepted, not used (as user)
    honoured: ClassVar = {
        "store": ((False,), "this server keeps no completions: send false, or leave it out"),
        "metadata": (({},), "metadata is kept with stored completions, and this server stores none: leave it out"),
        "service_tier": (("auto", "default"), "this server has one tier: send 'auto' or 'default', or leave it out"),
    }


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False                           # the prompt first in the answer (with logprobs: scored)
    logprobs: int | None = _range(None, minimum=0, maximum=20)   # log-probabilities of the tokens, with this many best
    best_of: int | None = None                   # only 1: each of the n choices is an answer of its own
    suffix: str | None = None                    # only "": no text after the completion (no fill-in-the-middle)
    honoured: ClassVar = _Sampling.honoured | {
        "best_of": ((1,), "this server returns every answer it makes (no best_of): use n, or send 1"),
        "suffix": (("",), "this model does not fill in the middle: leave 'suffix' out"),
    }


class TextPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCall(_Body):
    name: str
    arguments: str                               # JSON text, as the model wrote it


class ToolCall(_Body):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: str = Field(json_schema_extra={"enum": ["system", "developer", "user", "assistant", "tool"]})
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None     # an assistant's calls, sent back with the tools' results
    tool_call_id: str | None = None              # a tool message: the call it answers
    refusal: str | None = None                   # accepted, not used
    # an assistant message as the SDK returns it (message.model_dump()) carries these, null or empty
    annotations: list | None = None
    audio: dict | None = None
    function_call: dict | None = None
    honoured: ClassVar = {
        "annotations": (([],), "this server makes no annotations: send [] or null"),
        "audio": ((), "this server answers in text only: leave 'audio' out"),
        "function_call": ((), "send the call in 'tool_calls' (function_call is OpenAI's older form)"),
    }

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict | None = None               # a JSON schema of the arguments (None: no arguments)
    strict: bool | None = None                   # accepted: the arguments always follow the schema here


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class _FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: _FunctionName


class ChatRequest(_Sampling):
    messages: list[Message] = Field(json_schema_extra={"minItems": 1})
    max_completion_tokens: int | None = _range(None, minimum=0)     # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = _range(None, minimum=0, maximum=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None   # None: auto with tools
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    prompt_cache_key: str | None = None          # accepted: prefix caching finds shared prompts by content
    honoured: ClassVar = _Sampling.honoured | {
        "reasoning_effort": (("none",), "this model does not reason before it answers: send 'none', or leave it out"),
        "verbosity": ((), "this server does not steer an answer's length that way: use max_tokens"),
        "modalities": ((["text"],), "this server answers in text only: send [\"text\"], or leave it out"),
        "audio": ((), "this server answers in text only: leave 'audio' out"),
        "prediction": ((), "predicted outputs are not supported: leave 'prediction' out (--speculative drafts "
                           "from the prompt instead)"),
        "web_search_options": ((), "this server does not search the web: leave 'web_search_options' out"),
        "functions": ((), "send them as 'tools' (functions is OpenAI's older form)"),
        "function_call": ((), "send 'tool_choice' (function_call is OpenAI's older form)"),
    }


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's shape): a text, or chat messages through the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True              # accepted; the model's tokenizer adds none to a text
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def openapi_bodies(*models) -> tuple[dict, dict]:
    """The routes' request bodies for the OpenAPI document (/openapi.json, /docs): the routes read their
    bodies themselves (for OpenAI's error shape and the size limit), so FastAPI cannot see them. Returns
    {model: the route's openapi_extra} and the schemas they refer to, for components/schemas."""
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template="#/components/schemas/{model}")
    bodies = {m: {"requestBody": {"required": True, "content": {"application/json": {"schema": refs[m, "validation"]}}}}
              for m in models}
    return bodies, defs["$defs"]


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             413: "invalid_request_error", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def validation_message(err) -> tuple[str, str | None]:
    """One problem pydantic found, as (message, param)."""
    # one error, chosen the same way whatever order pydantic lists them in: an unknown field first (it is
    # often why a required one is missing: 'prompt' sent to chat), then a missing one, then the first other
    e = min(err.errors(), key=lambda e: {"extra_forbidden": 0, "missing": 1}.get(e["type"], 2))
    tags = ("str", "int", "float", "bool", "none")     # pydantic names the branch of a union it tried
    loc = [str(p) for p in e.get("loc", ()) if str(p) not in tags and not str(p).startswith(("function-", "list["))]
    param = ".".join(loc) or None
    if e["type"] == "json_invalid":
        return f"the body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])}", None
    if e["type"] == "missing":
        return f"'{param}' is required", param
    if e["type"] == "extra_forbidden":
        return f"unrecognized request argument supplied: {param}", param
    if e["type"] == "model_type":
        return "the body must be a JSON object", None
    if e["type"] == "value_error":                   # a field's own rule (honoured): its message as written
        return f"'{param}': {e['ctx']['error']} (got {e.get('input')!r:.80})", param
    return f"'{param}': {e['msg']} (got {e.get('input')!r:.80})", param
