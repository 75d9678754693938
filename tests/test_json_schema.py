"""Walking a JSON schema before generation: whether any finite value satisfies it, and every object closed."""
import pytest

from minillm.json_schema import closed, unsatisfiable

REF = {"$defs": {"Unit": {"enum": ["c", "f"], "type": "string"}}, "type": "object", "required": ["unit"],
       "properties": {"unit": {"$ref": "#/$defs/Unit"}}}


@pytest.mark.parametrize("schema, satisfiable", [
    (True, True), ({}, True), (REF, True),
    (False, False), ({"enum": []}, False),
    ({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, False),
    ({"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}, False),
    ({"type": "object", "properties": {"x": {"$ref": "#"}}}, True),                     # x may be left out
    ({"anyOf": [{"type": "null"}, {"type": "object", "properties": {"x": {"$ref": "#"}}, "required": ["x"]}]}, True),
    ({"$defs": {"t": {"type": "object", "required": ["kids"],
                      "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}},
      "$ref": "#/$defs/t"}, True),                                                     # a leaf has kids: []
    ({"$defs": {"t": {"type": "object", "required": ["kids"],
                      "properties": {"kids": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/t"}}}}},
      "$ref": "#/$defs/t"}, False),                                                    # no leaf can exist
    ({"type": "object", "properties": {"x": False}, "required": ["x"]}, False),
    ({"type": "object", "required": ["y"], "additionalProperties": False}, False),
    ({"type": "object", "required": 3}, True),                 # malformed: left to the grammar compiler
    ({"properties": {"args": {"$id": "urn:t", "$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
      "required": ["args"], "type": "object"}, False),         # pointers resolve inside their $id resource
])
def test_unsatisfiable(schema, satisfiable):
    assert (unsatisfiable(schema) is None) == satisfiable


def test_closed_at_every_depth_unless_the_object_says_otherwise():
    schema = {"type": "object", "properties": {
        "loc": {"$ref": "#/$defs/L"},
        "o": {"type": "object", "properties": {"a": {}}},
        "open": {"type": "object", "additionalProperties": {"type": "object", "properties": {"z": {}}}},
        "list": {"type": "array", "items": {"properties": {"k": {}}}}},
        "$defs": {"L": {"type": "object", "properties": {"x": {}}}}}
    c = closed(schema)
    assert c["additionalProperties"] is False
    assert c["properties"]["o"]["additionalProperties"] is False
    assert c["$defs"]["L"]["additionalProperties"] is False
    assert c["properties"]["list"]["items"]["additionalProperties"] is False
    assert c["properties"]["open"]["additionalProperties"]["additionalProperties"] is False    # its values
    assert "additionalProperties" not in schema                                                 # not changed
    both = closed({"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]})
    assert all("additionalProperties" not in branch for branch in both["allOf"])      # one object together
