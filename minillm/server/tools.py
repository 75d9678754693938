"""Tool calls (OpenAI's `tools`) for a model whose chat template has no tool syntax.

SmolLM2's template is plain ChatML: system, user and assistant turns. The server writes tools into it
in the convention of Hermes and Qwen2.5 (which many small models have seen), and a grammar makes sure
the model's answer follows it:

    system turn      its text, then "# Tools" with one JSON line per function between <tools> and </tools>,
                     and how to call them
    assistant call   <tool_call>
                     {"name":"get_weather","arguments":{"city":"Paris"}}
                     </tool_call>                      (one block per call, a newline between blocks)
    tool result      a user turn: <tool_response>
                                  {the tool's content}
                                  </tool_response>

tool_choice:
    "none"              no tools in the prompt, no grammar: a plain answer
    "auto" (default)    text (not starting with "<") or calls: the grammar allows either
    "required"          one call or more, of any function
    {"function": ...}   calls of that function only
parallel_tool_calls false allows one call per answer. The calls' arguments follow each function's
`parameters` schema (with no properties beyond those it lists, unless it says additionalProperties); the answer is parsed back into OpenAI's `tool_calls`, streamed one whole call per
chunk (each call's id, name and arguments together).
"""
from __future__ import annotations

import json
import re
import uuid
from urllib.parse import quote

from ..json_schema import closed
from ..structured import json_schema_grammar, lark_grammar, schema_text

CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
ANY_TEXT = r"/[^<](.|\n)*/"          # a text answer under "auto": anything not starting with "<"
_COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def tools_prompt(tools: list[dict]) -> str:
    """What the system turn gains: the functions and the format of a call."""
    lines = "\n".join(schema_text({"type": "function", "function": t}) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to help with the user's request. The functions, "
            f"as JSON schemas:\n<tools>\n{lines}\n</tools>\n\nTo call a function, answer with a JSON object with "
            "its name and arguments between <tool_call> and </tool_call> tags:\n"
            '<tool_call>\n{"name":<function name>,"arguments":<arguments as a JSON object>}\n</tool_call>')


def render_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """OpenAI messages (assistant tool_calls, tool results, tools offered) -> ChatML's system, user and
    assistant turns of text."""
    out = []
    for m in messages:
        role, text = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [CALL_OPEN + schema_text({"name": c["function"]["name"],
                                              "arguments": _arguments(c["function"]["arguments"])}) + CALL_CLOSE
                     for c in m["tool_calls"]]
            text = "\n".join(([text] if text else []) + calls)
        elif role == "tool":
            role, text = "user", f"<tool_response>\n{text}\n</tool_response>"
        out.append({"role": role, "content": text})
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + tools_prompt(tools)}
        else:
            out.insert(0, {"role": "system", "content": tools_prompt(tools)})
    return out


def _arguments(text: str):
    """A call's arguments as sent back by a client (a JSON string), as an object for the prompt."""
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return text


def call_schema(tool: dict) -> dict:
    """The JSON of one call of this function: its name, then its arguments under its parameters schema.
    A function takes the arguments it declares: unless its schema says otherwise, no others, in every
    object at every depth (a small model offered "any other property" invents them until max_tokens)."""
    params = closed(tool.get("parameters") or {"type": "object", "properties": {}})
    # its own resource ($id): its '#/$defs/...' pointers resolve inside it, not in the schema around it
    params = {"$id": f"urn:minillm:tool:{quote(tool['name'], safe='')}", **params}
    return {"type": "object", "properties": {"name": {"const": tool["name"]}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def tools_grammar(tools: list[dict], choice: str | None, parallel: bool, text_grammar: str | None = None) -> str:
    """The grammar of an answer under tool_choice `choice` ("auto", "required" or a function's name).
    text_grammar: the Lark rule body a text answer must follow under "auto" (None: any text not
    starting with "<")."""
    chosen = tools if choice in ("auto", "required") else [t for t in tools if t["name"] == choice]
    if not chosen:
        raise ValueError(f"tool_choice names the function {choice!r}, but 'tools' has "
                         f"{[t['name'] for t in tools]}")
    schema = {"x-guidance": _COMPACT, "anyOf": [call_schema(t) for t in chosen]}
    json_schema_grammar(schema)                 # a clear error for a bad parameters schema
    rules = [f"start: {'calls | text' if choice == 'auto' else 'calls'}",
             "calls: call" + (' ("\\n" call)*' if parallel else ""),
             f'call: "<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"']
    if choice == "auto":
        rules.append("text: " + (text_grammar or ANY_TEXT))
    return lark_grammar("\n".join(rules) + "\n")


def split_calls(text: str) -> tuple[list[dict], str]:
    """An answer -> (its whole tool-call blocks at the start, as OpenAI's tool_calls; the text after them).
    Plain text gives ([], text); calls cut short by max_tokens give the whole ones and the unfinished tail."""
    calls, pos = [], 0
    while m := _CALL.match(text, pos + (1 if calls and text.startswith("\n", pos) else 0)):
        try:
            call = json.loads(m.group(1))
            calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": call["name"], "arguments": schema_text(call["arguments"])}})
        except (ValueError, KeyError, TypeError):
            break
        pos = m.end()
    return calls, text[pos:]


def split_answer(text: str) -> tuple[list[dict], str | None]:
    """An answer under tools -> (its whole calls, its text content). An answer that is calls has no content:
    a call max_tokens cut short is dropped (finish_reason "length" says so), never sent as raw markup."""
    calls, rest = split_calls(text)
    tail = rest.lstrip("\n") if calls else rest
    if calls or tail.startswith(CALL_OPEN) or tail and CALL_OPEN.startswith(tail):
        return calls, None
    return [], text


def parse_calls(text: str) -> list[dict] | None:
    """An answer made only of tool-call blocks -> OpenAI's tool_calls; None if it is not one."""
    calls, rest = split_calls(text)
    return calls if calls and not rest.strip() else None


class ToolCallStream:
    """One streamed choice under tools: text deltas pass through as content; an answer that starts with
    a call is held until each call is whole, then sent as one tool_calls delta. A call that max_tokens
    cuts short is dropped, as in the whole answer (split_answer): no raw markup reaches content."""

    def __init__(self):
        self.text = ""
        self.mode: str | None = None      # None: undecided, "text", "calls"
        self.num_calls = 0
        self.sent = 0                     # characters of text sent (as content or inside calls)

    def push(self, new_text: str, finished: bool) -> list[dict]:
        """The deltas (each {"content": ...} or {"tool_calls": [...]}) to send for this new text."""
        self.text += new_text
        if self.mode is None and self.text:
            self.mode = "calls" if CALL_OPEN.startswith(self.text[:len(CALL_OPEN)]) else "text"
        deltas = []
        while self.mode == "calls":
            start = self.sent + (1 if self.num_calls and self.text.startswith("\n", self.sent) else 0)
            m = _CALL.match(self.text, start)
            calls = parse_calls(m.group(0)) if m else None
            if calls is None:
                break
            deltas.append({"tool_calls": [{"index": self.num_calls, **calls[0]}]})
            self.num_calls, self.sent = self.num_calls + 1, m.end()
        if self.mode == "text" and len(self.text) > self.sent:
            deltas.append({"content": self.text[self.sent:]})
            self.sent = len(self.text)
        return deltas

    @property
    def called(self) -> bool:
        return self.num_calls > 0
