"""Structured output in the engine: every answer under a JSON schema parses and validates, on the real
model, greedy and sampled; the mask is the grammar's (checked bit by bit), never empty, allows the end
tokens once the answer is complete, and touches no other request of the batch. Preemption (the answer
recomputed) and the prefix cache keep it valid, and a bad schema is a clear ValueError."""
import json

import jsonschema
import pytest
import torch

import minillm
from minillm import structured as S
from minillm.engine import LLMEngine
from minillm.sampling import SamplingParams

SCHEMAS = {
    "nested_object": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                  "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"}},
                 "required": ["name", "email"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "enum_and_numbers": {"type": "object", "properties": {
        "planet": {"enum": ["Mercury", "Venus", "Earth", "Mars"]},
        "moons": {"type": "integer", "minimum": 0, "maximum": 200},
        "gravity": {"type": "number"}, "habitable": {"type": "boolean"}},
        "required": ["planet", "moons", "gravity", "habitable"], "additionalProperties": False},
    "array_of_objects": {"type": "array", "minItems": 2, "maxItems": 3, "items": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"], "additionalProperties": False}},
    "array_of_enums": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}},
        "required": ["colors"], "additionalProperties": False},
}
ASK = {"nested_object": "Invent a user with a name and an email address.",
       "enum_and_numbers": "Describe the planet Mars.",
       "array_of_objects": "Name two cities and their countries.",
       "array_of_enums": "Which colors are in the French flag?"}


@pytest.fixture(scope="module")
def tok():
    return minillm.load_tokenizer()


def chat(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text + " Answer in JSON."}])


def run(engine, prompts, params):
    ids = [engine.add_request(f"r{i}", p, ps) for i, (p, ps) in enumerate(zip(prompts, params))]
    finals, steps = {}, 0
    while engine.has_unfinished_requests():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
        steps += 1
        assert steps < 2000
    return [finals[i] for group in ids for i in group]


# ------------------------------------------------------------ the mask itself
def test_bitmask_unpacks_bit_by_bit():
    g = torch.Generator().manual_seed(0)
    for rows, vocab in [(1, 32), (3, 45), (2, 300), (4, 49152)]:
        words = torch.randint(-2**31, 2**31 - 1, (rows, (vocab + 31) // 32), generator=g, dtype=torch.int64)
        bitmask = words.to(torch.int32)
        want = torch.tensor([[bool((int(words[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)]
                             for r in range(rows)])
        assert torch.equal(S.bitmask_to_bool(bitmask, vocab), want)
        logits = torch.randn(rows, vocab, generator=g)
        masked = S.apply_bitmask(logits, bitmask)
        assert torch.equal(masked[want], logits[want]) and torch.isinf(masked[~want]).all()


def test_mask_follows_a_valid_answer_and_allows_the_end_only_when_complete(tok):
    schema = SCHEMAS["enum_and_numbers"]
    answer = json.dumps({"planet": "Mars", "moons": 2, "gravity": 3.7, "habitable": False}, separators=(",", ":"))
    c = S.Constraint(S.json_schema_grammar(schema), tok)
    bitmask = S.allocate_bitmask(1, tok.vocab_size)
    ids = tok.encode(answer)
    for j, t in enumerate(ids):
        c.fill(bitmask[0])
        allowed = S.bitmask_to_bool(bitmask, tok.vocab_size)[0]
        assert allowed.any() and allowed[t], (j, tok.id_to_piece(t))
        assert not any(allowed[s] for s in tok.stop_ids), "the end offered before the answer is complete"
        assert c.accept(t)
    c.fill(bitmask[0])
    allowed = S.bitmask_to_bool(bitmask, tok.vocab_size)[0]
    assert c.done and set(allowed.nonzero().flatten().tolist()) == tok.stop_ids   # nothing else can follow
    wrong = S.Constraint(S.json_schema_grammar(schema), tok)
    assert not wrong.accept(tok.encode("[")[0])                                    # an array is not an object


@pytest.mark.parametrize("schema, message", [
    ({"type": "strnig"}, "strnig"),
    ({"type": "object", "properties": {"a": {"$ref": "#/definitions/nope"}}}, "nope"),
    ({"type": "number", "minimum": "x"}, "minimum"),
    ([1, 2], "object"),
])
def test_a_bad_schema_says_what_is_wrong(schema, message):
    with pytest.raises(ValueError, match="JSON schema") as e:
        S.json_schema_grammar(schema)
    assert message in str(e.value)


def test_a_grammar_is_the_engines_and_needs_the_end_token():
    g = S.json_object_grammar()
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(grammar=g, ignore_eos=True)
    with pytest.raises(ValueError, match="grammar"):
        SamplingParams(grammar={"type": "object"})


# ------------------------------------------------------------ on the real model
@pytest.mark.slow
def test_every_answer_validates_against_its_schema(model, tok):
    """Greedy and sampled (two seeds), the four schemas in one batch, beside an unconstrained request
    that gives the same tokens as alone."""
    engine = LLMEngine(model, tok, verbose=False)
    names = list(SCHEMAS)
    free = chat(tok, "Name a color.")
    alone = run(engine, [free], [SamplingParams(max_tokens=12)])[0].token_ids
    prompts, params = [], []
    for name in names:
        g = S.json_schema_grammar(SCHEMAS[name])
        for p in (SamplingParams(max_tokens=80, grammar=g),
                  SamplingParams(max_tokens=80, grammar=g, temperature=1.0, seed=7)):
            prompts.append(chat(tok, ASK[name]))
            params.append(p)
    outs = run(engine, prompts + [free], params + [SamplingParams(max_tokens=12)])
    for out, name in zip(outs, [n for n in names for _ in range(2)]):
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])
    assert outs[-1].token_ids == alone


@pytest.mark.slow
def test_preemption_and_the_prefix_cache_keep_answers_valid(model, tok):
    """A pool too small for the batch preempts (answers recomputed); the same prompt twice shares its
    cached blocks. Greedy answers equal those of a roomy engine."""
    schema = SCHEMAS["array_of_objects"]
    g = S.json_schema_grammar(schema)
    prompts = [chat(tok, f"Name two cities of country number {i} and their countries.") for i in range(3)]
    prompts.append(prompts[0])
    params = [SamplingParams(max_tokens=60, grammar=g)] * 4
    roomy = [o.text for o in run(LLMEngine(model, tok, verbose=False), prompts, params)]
    tight = LLMEngine(model, tok, verbose=False, num_blocks=12, block_size=16)
    outs = run(tight, prompts, params)
    assert tight.scheduler.num_preemptions > 0 and tight.kv.prefix_cache_hits > 0
    assert [o.text for o in outs] == roomy
    for o in outs:
        jsonschema.validate(json.loads(o.text), schema)


@pytest.mark.slow
def test_n_samples_each_follow_the_grammar(model, tok):
    engine = LLMEngine(model, tok, verbose=False)
    g = S.json_schema_grammar(SCHEMAS["array_of_enums"])
    ids = engine.add_request("x", chat(tok, ASK["array_of_enums"]),
                             SamplingParams(max_tokens=40, grammar=g, temperature=1.0, seed=3), n=3)
    finals = {}
    while engine.has_unfinished_requests():
        finals |= {o.request_id: o for o in engine.step() if o.finished}
    outs = [finals[i] for i in ids]
    for o in outs:
        jsonschema.validate(json.loads(o.text), SCHEMAS["array_of_enums"])
