"""Two questions about a JSON schema, answered by walking it before any token is generated.

- `unsatisfiable(schema)`: can no finite JSON value validate against it? Then a grammar built from it
  has no end, and the model could only stop at once (an empty answer) or run to max_tokens. Examples:
  {"$ref": a} with a = {"$ref": b} and b = {"$ref": a}; an object whose required property must itself
  be such an object, forever. The walk is a least fixpoint: every `$ref` starts as "no value known",
  and passes over the schema turn references true as values are found, until nothing changes.
- `closed(schema)`: the same schema with every object that does not set additionalProperties (or
  patternProperties, unevaluatedProperties) given "additionalProperties": false, at every depth.
  Tool arguments follow this rule: a small model offered "any other property" invents them.

Only what decides these is read (types, required, items, anyOf/oneOf/allOf, enum, $ref);
string lengths, patterns and number ranges are taken as satisfiable.
"""
from __future__ import annotations

from urllib.parse import unquote

_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_LISTS = ("anyOf", "oneOf", "prefixItems")
_ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def _resolve(ref: str, root: dict):
    """The subschema a local '#/...' pointer names in root (None if it names nothing)."""
    node = root
    for part in ref[1:].lstrip("/").split("/") if ref != "#" else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _has_value(s, root, known: dict, busy: set) -> bool:
    """Whether some finite JSON value validates against s, given what `known` says of each $ref target."""
    if s is True or s == {}:
        return True
    if not isinstance(s, dict):
        return False                                       # false, or not a schema
    root = s if "$id" in s else root                       # a resource of its own: its pointers start here
    ref = s.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        target = _resolve(ref, root)
        if target is None:
            return True                                    # (the grammar compiler names a pointer to nothing)
        key = id(target)
        if key not in busy:                                # a reference back into itself: what is known so far
            busy.add(key)
            known[key] = known.get(key, False) or _has_value(target, root, known, busy)
            busy.discard(key)
        if not known.get(key, False):
            return False
    if "enum" in s and not s["enum"]:
        return False
    if "anyOf" in s and not any(_has_value(x, root, known, busy) for x in s["anyOf"]):
        return False
    if "oneOf" in s and not any(_has_value(x, root, known, busy) for x in s["oneOf"]):
        return False
    if "allOf" in s and not all(_has_value(x, root, known, busy) for x in s["allOf"]):
        return False
    if "enum" in s or "const" in s:
        return True
    types = s.get("type")
    types = [types] if isinstance(types, str) else types
    if types is None:                                      # any type: a number or null does unless "object" is forced
        return True
    return any(_type_has_value(t, s, root, known, busy) for t in types)


def _type_has_value(t: str, s: dict, root, known, busy) -> bool:
    if t == "object":
        props, extra = s.get("properties", {}), s.get("additionalProperties", True)
        return all(_has_value(props[r] if r in props else extra, root, known, busy) for r in s.get("required", ()))
    if t == "array":
        need = s.get("minItems", 0)
        prefix = s.get("prefixItems", [])
        if not all(_has_value(x, root, known, busy) for x in prefix[:need]):
            return False
        return need <= len(prefix) or _has_value(s.get("items", True), root, known, busy)
    return True


def unsatisfiable(schema) -> str | None:
    """None if some finite JSON value can satisfy schema; else a short sentence saying why none can."""
    if schema is False:
        return "the schema is false: no value satisfies it"
    known: dict[int, bool] = {}
    while True:
        before = dict(known)
        try:
            found = _has_value(schema, schema, known, set())
        except (TypeError, AttributeError, RecursionError):    # not a well-formed schema: the compiler says why
            return None
        if found:
            return None
        if known == before:
            return ("no finite JSON value satisfies this schema: every way through it comes back to a '$ref' or a "
                    "required property that needs itself (or an empty enum, or false)")


def closed(schema, top: bool = True):
    """schema with every object closed (no properties beyond those listed) unless it says otherwise. The
    branches of an allOf are left open at their own top level: they describe one object together."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: closed(v) for k, v in out[key].items()}
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(v) for v in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed(v, top=False) for v in out["allOf"]]
    for key in _ONES:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    types = out.get("type")
    is_object = types == "object" or isinstance(types, list) and "object" in types or \
        types is None and "properties" in out
    opened = {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(out) or "allOf" in out
    if top and is_object and not opened:
        out["additionalProperties"] = False
    return out
