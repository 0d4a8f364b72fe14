"""Structured outputs: every output follows its grammar (JSON schema, regex, choice, EBNF), with
and without speculation, and speculation keeps the constrained distribution exactly."""
import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from scipy import stats

from moespec import LLM, SamplingParams, StructuredOutputs
from moespec.sampling import SamplingBatch, compute_probs, unpack_bitmask
from moespec.structured import GrammarError, Grammars

CHECKPOINTS = Path(__file__).resolve().parent.parent / "checkpoints"
DEEPSEEK = str(CHECKPOINTS / "tiny-deepseek-v3")
LLAMA, LLAMA_DRAFT = str(CHECKPOINTS / "tiny-llama"), str(CHECKPOINTS / "tiny-llama-draft")
LLAMA_HEAD = str(CHECKPOINTS / "tiny-llama-mtp-head")

SCHEMAS = [
    {  # nested object, enum, boolean, bounded integer
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8},
                       "kind": {"enum": ["module", "class", "function"]},
                       "meta": {"type": "object",
                                "properties": {"line": {"type": "integer", "minimum": 0, "maximum": 9999},
                                               "public": {"type": "boolean"}},
                                "required": ["line", "public"]}},
        "required": ["name", "kind", "meta"]},
    {  # array of objects
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                 "items": {"type": "object",
                                           "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                                                          "tag": {"enum": ["a", "b", "c"]}},
                                           "required": ["id", "tag"]}}},
        "required": ["items"]},
    {  # enums, nullable string, array of strings
        "type": "object",
        "properties": {"status": {"enum": ["ok", "error", "pending"]},
                       "labels": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
                       "note": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["status", "labels", "note"]},
]
STARTS = ["def parse(text):\n", "import json\n", "class Record:\n", "# settings\n", "return {", "config = ",
          "for item in items:\n", "    data = ", "if __name__ == '__main__':\n"]
MAX_TOKENS = 160  # room for every schema above to close
MODES = {
    "none": (DEEPSEEK, None),
    "mtp-k1": (DEEPSEEK, {"mode": "mtp", "num_speculative_tokens": 1, "adaptive": False}),
    "mtp-k3": (DEEPSEEK, {"mode": "mtp", "num_speculative_tokens": 3, "adaptive": False}),
    "llama-none": (LLAMA, None),
    "draft-k4": (LLAMA, {"mode": "draft", "draft_model": LLAMA_DRAFT, "num_speculative_tokens": 4,
                         "adaptive": False}),
    "head-k2": (LLAMA, {"mode": "mtp", "mtp_head": LLAMA_HEAD, "num_speculative_tokens": 2, "adaptive": False}),
    "mtp-adaptive": (DEEPSEEK, {"mode": "mtp", "num_speculative_tokens": 3, "adaptive": True}),
    "mtp-tree": (DEEPSEEK, {"mode": "mtp", "num_speculative_tokens": 3, "adaptive": False,
                            "tree": {"top_k": 3, "depth": 3, "num_draft_tokens": 6}}),
    "draft-tree": (LLAMA, {"mode": "draft", "draft_model": LLAMA_DRAFT, "num_speculative_tokens": 4,
                           "adaptive": False, "tree": {"top_k": 2, "depth": 4, "num_draft_tokens": 7}}),
}
REFERENCE = {"none": "none", "mtp-k1": "none", "mtp-k3": "none", "mtp-adaptive": "none", "llama-none": "llama-none",
             "draft-k4": "llama-none", "head-k2": "llama-none", "mtp-tree": "none", "draft-tree": "llama-none"}


@pytest.fixture(scope="module")
def engines():
    """One LLM per mode, built when first asked for."""
    built = {}

    def get(mode: str) -> LLM:
        if mode not in built:
            path, spec = MODES[mode]
            built[mode] = LLM(model=path, dtype="float32", speculation=spec, page_size=16, num_kv_pages=1024,
                              max_num_seqs=64)
        return built[mode]

    return get


def prompts(count: int) -> list[str]:
    return [f"{STARTS[i % len(STARTS)]}# record {i}\n" for i in range(count)]


def json_params(count: int, temperature: float, seed: int | None = None) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, seed=None if seed is None else seed + i,
                           structured=StructuredOutputs(json=SCHEMAS[i % len(SCHEMAS)])) for i in range(count)]


def check_json_outputs(outputs, count: int) -> list[str]:
    """Every output parses and validates against its schema; returns the finish reasons."""
    reasons = []
    for i, out in enumerate(outputs):
        completion = out.outputs[0]
        jsonschema.validate(json.loads(completion.text), SCHEMAS[i % len(SCHEMAS)])
        assert completion.token_ids[-1] == 1  # ended by EOS, which the grammar allowed only once complete
        reasons.append(completion.finish_reason)
    assert len(reasons) == count
    return reasons


# ---------------------------------------------------------------------- constraints and masks


@pytest.mark.parametrize("spec, field", [
    (dict(json={"type": "nonsense"}), "json"), (dict(json="{not json"), "json"), (dict(json=[1]), "json"),
    (dict(regex="a(b"), "regex"), (dict(grammar='root ::= foo'), "grammar"), (dict(grammar='x ::= "a"'), "grammar"),
    (dict(choice=[]), "choice"), (dict(choice="yes"), "choice"), (dict(choice=["a", ""]), "choice"),
])
def test_bad_constraints_are_value_errors_naming_the_field(spec, field):
    with pytest.raises(GrammarError, match=rf"^StructuredOutputs\.{field}: ") as error:
        StructuredOutputs(**spec)
    assert error.value.field == field
    with pytest.raises(ValueError, match=rf"^SamplingParams\.structured: StructuredOutputs\.{field}: "):
        SamplingParams(structured=spec)


def test_exactly_one_constraint_and_no_min_tokens():
    with pytest.raises(ValueError, match="set exactly one of .* got json, regex"):
        StructuredOutputs(json={}, regex="a")
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputs()
    with pytest.raises(ValueError, match=r"^SamplingParams\.min_tokens=3: must be 0 with structured"):
        SamplingParams(min_tokens=3, structured={"regex": "a+"})
    params = SamplingParams(structured={"json": '{"type": "object",  "properties": {"b": {}, "a": {}}}'})
    assert params.structured == StructuredOutputs(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert params.structured.json == '{"type":"object","properties":{"b":{},"a":{}}}'  # property order kept
    hash(params)


def test_masks_pad_the_vocab_and_never_allow_special_tokens():
    """The model's vocab_size may exceed the tokenizer's: padded ids are never allowed, nor are
    special tokens other than EOS, which is allowed exactly where the grammar can end."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(DEEPSEEK)
    V = 4100  # the tokenizer has 4096 tokens
    grammars = Grammars(tokenizer, V, frozenset({1}))
    state = grammars.matcher(StructuredOutputs(choice=["yes", "no"]))
    allowed = unpack_bitmask(grammars.masks([state, None]), V)  # [2, V]
    assert allowed.shape == (2, V) and allowed[1].all()  # a row without a grammar allows everything
    first = {tokenizer.decode([t]) for t in allowed[0].nonzero().flatten().tolist()}
    assert first == {"y", "ye", "yes", "n", "no"} & {tokenizer.decode([t]) for t in range(4096)}
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert not unpack_bitmask(grammars.masks([state]), V)[0, 1]  # EOS only once the output is complete
        assert state.accept(token)
    assert unpack_bitmask(grammars.masks([state]), V)[0].nonzero().flatten().tolist() == [1]
    json_state = grammars.matcher(StructuredOutputs(json_object=True))
    assert state.accept(1) and state.terminated
    for token in tokenizer.encode('{"a": "', add_special_tokens=False):
        assert json_state.accept(token)
    inside_string = unpack_bitmask(grammars.masks([json_state]), V)[0]
    assert inside_string[7:4096].sum() > 3000 and not inside_string[:7].any() and not inside_string[4096:].any()


def test_mask_applies_after_penalties_and_before_top_k():
    """Masked tokens get probability 0; top-k picks among the allowed tokens (so it never empties
    a row); greedy rows take the best allowed token."""
    V = 64
    logits = torch.arange(V, dtype=torch.float32).repeat(2, 1)  # token 63 is the best
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    bitmask[:, 0] = 0b1110  # tokens 1, 2, 3
    params = [SamplingParams(temperature=1.0, top_k=2, logit_bias={3: -10.0}), SamplingParams(temperature=0.0)]
    batch = SamplingBatch.build(params, [[0], [0]], [[], []], V, "cpu").constrained(bitmask, V)
    probs = compute_probs(logits, batch)
    assert probs[0].nonzero().flatten().tolist() == [1, 2]  # bias moved 3 below 2; top-2 of {1, 2, 3}
    assert probs[1].nonzero().flatten().tolist() == [3]
    assert unpack_bitmask(torch.zeros(1, 2, dtype=torch.int32), V).all()  # a dead end masks nothing


# ---------------------------------------------------------------------- end to end


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["none", "mtp-k1", "mtp-k3", "draft-k4"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schemas_hold_over_many_prompts(engines, mode, temperature):
    count = 54
    llm = engines(mode)
    before = (llm.engine.spec_stats.steps, llm.engine.spec_stats.accepted_tokens)
    outputs = llm.generate(prompts(count), json_params(count, temperature), use_tqdm=False)
    reasons = check_json_outputs(outputs, count)
    steps, accepted = (now - then for now, then in zip((llm.engine.spec_stats.steps,
                                                        llm.engine.spec_stats.accepted_tokens), before))
    accept_length = (accepted + steps) / steps if steps else None
    print(f"structured sweep: mode={mode} temperature={temperature} prompts={count} valid={count}/{count} "
          f"stop={reasons.count('stop')}/{count} accept_length={accept_length}")
    assert reasons == ["stop"] * count


@pytest.fixture(scope="module")
def reference(engines):
    """Outputs without speculation, per (model, temperature, seed), computed once."""
    done = {}

    def get(mode: str, count: int, temperature: float, seed: int | None):
        key = (REFERENCE[mode], count, temperature, seed)
        if key not in done:
            done[key] = engines(key[0]).generate(prompts(count), json_params(count, temperature, seed), use_tqdm=False)
            check_json_outputs(done[key], count)
        return done[key]

    return get


@pytest.mark.parametrize("mode", ["mtp-k1", "mtp-k3", "mtp-adaptive", "draft-k4", "head-k2", "mtp-tree", "draft-tree"])
def test_constrained_output_under_speculation(engines, reference, mode):
    """Every output validates against its schema, and greedy and seeded outputs are token-identical
    to no speculation: greedy rows take the best allowed token, seeded rows the keyed draw from the
    constrained distribution, both functions of the target's masked distribution alone. (The
    54-prompt sweep per mode and temperature is marked slow.)"""
    count = 6
    llm = engines(mode)
    for temperature, seed in ((0.0, None), (1.0, 100)):
        ref = reference(mode, count, temperature, seed)
        steps = llm.engine.spec_stats.steps
        got = llm.generate(prompts(count), json_params(count, temperature, seed), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
        assert llm.engine.spec_stats.steps > steps
    if "tree" in mode:  # the grammar rows were verified as trees, not as chains
        assert sum(n for n, _ in llm.engine.spec_stats.by_tree.values()) == llm.engine.spec_stats.steps
    assert check_json_outputs(llm.generate(prompts(count), json_params(count, 1.0), use_tqdm=False),
                              count) == ["stop"] * count


CHOICES = ["yes", "no", "maybe", "never"]
CHOICE_PARAMS = dict(temperature=1.0, max_tokens=16, structured=StructuredOutputs(choice=CHOICES))


@pytest.fixture(scope="module")
def random_deepseek(tmp_path_factory):
    """A random tiny DeepSeek-V3 with an MTP layer over the project tokenizer (fast, and its
    random MTP layer's drafts are often rejected)."""
    from test_server import save_tiny_deepseek_mtp
    path = tmp_path_factory.mktemp("random-deepseek")
    save_tiny_deepseek_mtp(path, vocab_size=4096)
    return str(path)


@pytest.fixture(scope="module")
def exact_choices(random_deepseek) -> dict[str, float]:
    """The constrained distribution over the choices from the target alone: every token path the
    grammar allows, with the product of its masked probabilities along the way (no engine)."""
    from transformers import AutoTokenizer

    from moespec.models import load_model
    from reference import paged_forward
    model = load_model(random_deepseek, show_progress=False)
    tokenizer = AutoTokenizer.from_pretrained(random_deepseek)
    V = model.config.vocab_size
    grammars, params = Grammars(tokenizer, V, frozenset({1})), SamplingParams(**CHOICE_PARAMS)
    prompt = tokenizer.encode(CHOICE_PROMPT, add_special_tokens=False)
    texts: dict[str, float] = {}
    frontier = {(): 1.0}
    while frontier:
        paths = list(frontier)
        logits = torch.stack([o[-1] for o in paged_forward(model, [prompt + list(p) for p in paths])])
        states = [grammars.matcher(params.structured) for _ in paths]
        for state, path in zip(states, paths):
            assert all(state.accept(t) for t in path)
        batch = SamplingBatch.build([params] * len(paths), [prompt] * len(paths), [list(p) for p in paths], V, "cpu")
        probs = compute_probs(logits, batch.constrained(grammars.masks(states), V))
        grown = {}
        for path, row in zip(paths, probs):
            for t in row.nonzero().flatten().tolist():
                if t == 1:  # EOS: the output is complete
                    text = tokenizer.decode(list(path))
                    texts[text] = texts.get(text, 0.0) + frontier[path] * row[t].item()
                else:
                    grown[path + (t,)] = frontier[path] * row[t].item()
        frontier = grown
    assert set(texts) == set(CHOICES) and sum(texts.values()) == pytest.approx(1.0, abs=1e-5)
    return texts


CHOICE_PROMPT = "answer = "


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection-sampling", "keyed-draws"])
def test_speculative_constrained_sampling_follows_the_constrained_distribution(random_deepseek, exact_choices,
                                                                                seeded):
    """A choice of four strings (1 to 5 tokens each): outputs with MTP k=2, as a chain and as a
    tree, follow the exact constrained distribution of the target alone, as do outputs without
    speculation, and the samples agree with each other (chi-square)."""
    n = 1500
    params = [SamplingParams(**CHOICE_PARAMS, seed=5000 + i if seeded else None) for i in range(n)]
    expected = [exact_choices[c] * n for c in CHOICES]
    counts = []
    tree = {"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False,
            "tree": {"top_k": 2, "depth": 2, "num_draft_tokens": 4}}
    for spec in (None, {"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False}, tree):
        llm = LLM(model=random_deepseek, page_size=4, num_kv_pages=4096, max_num_seqs=512, speculation=spec)
        outputs = llm.generate([CHOICE_PROMPT] * n, params, use_tqdm=False)
        assert all(o.outputs[0].finish_reason == "stop" for o in outputs)
        counts.append([sum(o.outputs[0].text == c for o in outputs) for c in CHOICES])
        print(f"choice counts, speculation {spec}: {dict(zip(CHOICES, counts[-1]))}, expected {expected}")
        assert sum(counts[-1]) == n
        assert stats.chisquare(counts[-1], expected, sum_check=False).pvalue > 1e-3
    s = llm.engine.spec_stats
    assert s.steps > 0 and 0 < s.accepted_tokens < s.draft_tokens  # drafts were both kept and rejected
    assert stats.chi2_contingency(counts).pvalue > 1e-3, counts


GRAMMARS = [  # (constraint, how to check an output)
    (dict(regex=r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"), lambda t: re.fullmatch(r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)", t)),
    (dict(choice=CHOICES), lambda t: t in CHOICES),
    (dict(grammar='root ::= item (", " item)?\nitem ::= [0-9] [0-9]? | "none"'),
     lambda t: re.fullmatch(r"([0-9]{1,2}|none)(, ([0-9]{1,2}|none))?", t)),
]


@pytest.mark.parametrize("constraint, holds", GRAMMARS, ids=["regex", "choice", "ebnf"])
def test_regex_choice_and_ebnf_grammar(random_deepseek, constraint, holds):
    spec = {"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    llm = LLM(model=random_deepseek, page_size=4, num_kv_pages=1024, max_num_seqs=32, speculation=spec)
    params = [SamplingParams(temperature=t, seed=s, max_tokens=64, structured=constraint)
              for t, s in ((0.0, None), (1.0, None), (1.0, 7), (0.7, None))] * 3
    for out in llm.generate(["x = "] * len(params), params, use_tqdm=False):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop" and holds(completion.text), completion.text
    assert llm.engine.spec_stats.steps > 0


def test_finish_reasons_eos_and_logprobs_before_the_mask(random_deepseek):
    """max_tokens cutting a structure short gives `length`; a grammar that has accepted EOS ends
    the request with `stop`, ignore_eos or not; reported logprobs are the model's own, before
    the mask (as every other logit transform): a token the grammar forces has logprob < 0 and
    the top logprobs name tokens the grammar forbids."""
    llm = LLM(model=random_deepseek, page_size=4, num_kv_pages=1024,
              speculation={"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False})
    schema = StructuredOutputs(json=SCHEMAS[0])
    short, ignoring = llm.generate(["x = ", "x = "], [
        SamplingParams(temperature=0.0, max_tokens=5, structured=schema),
        SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True, structured=schema)], use_tqdm=False)
    assert short.outputs[0].finish_reason == "length" and short.outputs[0].text.startswith('{"name": ')
    assert ignoring.outputs[0].finish_reason == "stop" and ignoring.outputs[0].token_ids[-1] == 1
    jsonschema.validate(json.loads(ignoring.outputs[0].text), SCHEMAS[0])

    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, structured={"choice": ["maybe"]})
    constrained = llm.generate(["answer = "], params, use_tqdm=False)[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    assert constrained.text == "maybe"
    prompt = tokenizer.encode("answer = ", add_special_tokens=False)
    for i, lp in enumerate(constrained.logprobs):  # each position again, unconstrained: the same numbers
        assert lp.logprob < 0 and len(lp.top) == 5 and lp.token_id == constrained.token_ids[i]
        free = llm.generate([prompt + constrained.token_ids[:i]], SamplingParams(temperature=0.0, max_tokens=1,
                                                                                  logprobs=5), use_tqdm=False)
        top = free[0].outputs[0].logprobs[0].top
        assert list(top) == list(lp.top) and all(abs(top[t] - lp.top[t]) < 1e-4 for t in top)
        assert any(t != lp.token_id for t in lp.top)  # forbidden tokens among the top ones


def test_constrained_output_survives_preemption(random_deepseek):
    """Preempted requests recompute their KV; their grammars keep following the output tokens."""
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured=StructuredOutputs(json=SCHEMAS[i % 3]))
              for i in range(4)]
    batch = [f"row {i} = " for i in range(4)]
    ref = LLM(model=random_deepseek, page_size=4, num_kv_pages=256).generate(batch, params, use_tqdm=False)
    spec = {"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    llm = LLM(model=random_deepseek, page_size=4, num_kv_pages=24, max_num_batched_tokens=32, speculation=spec)
    got = llm.generate(batch, params, use_tqdm=False)
    assert sum(o.outputs[0].metrics.num_preemptions for o in got) > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert [o.outputs[0].text[:9] for o in got] == ['{"name": ', '{"items":', '{"status"', '{"name": ']


def test_a_model_without_tokenizer_refuses_structured_requests(tmp_path):
    from tiny_models import save_tiny_deepseek
    save_tiny_deepseek(tmp_path, layers=1)
    llm = LLM(model=str(tmp_path), page_size=4, num_kv_pages=64)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate([[1, 2, 3]], SamplingParams(structured={"regex": "a+"}), use_tqdm=False)
    assert not llm.engine.has_unfinished()


# ---------------------------------------------------------------------- HTTP server


@pytest.fixture(scope="module")
def served():
    """The committed tiny DeepSeek-V3 with its MTP layer (k=2) behind the OpenAI API."""
    import openai

    from moespec.config import build_config
    from moespec.engine import Engine
    from moespec.server import create_app
    from test_server import RunningServer
    config = build_config({}, {"model": DEEPSEEK, "dtype": "float32", "served_model_name": "tiny", "page_size": 16,
                               "num_kv_pages": 256, "max_num_seqs": 16,
                               "speculation": {"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False}})
    engine = Engine(config)
    with RunningServer(engine, create_app(engine, "tiny")) as running:
        yield running, openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_response_format_json_schema_through_the_openai_client(served):
    """As a user of the official client would ask for it: a json_schema response format, a
    pydantic model through `parse`, streaming, and the legacy completions API."""
    import pydantic
    server, client = served
    messages = [{"role": "user", "content": "Describe a Python module as JSON."}]
    for i, schema in enumerate(SCHEMAS):
        out = client.chat.completions.create(
            model="tiny", messages=messages, temperature=1.0, seed=i, max_completion_tokens=MAX_TOKENS,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "record", "schema": schema, "strict": True}})
        assert out.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)
        assert out.usage.speculation["accept_length"] > 1  # extra usage field of this server

    class Module(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        kind: str = pydantic.Field(pattern="^(module|package)$")
        lines: int = pydantic.Field(ge=0, le=999)

    parsed = client.chat.completions.parse(model="tiny", messages=messages, temperature=0.0, response_format=Module,
                                           max_completion_tokens=MAX_TOKENS)
    assert isinstance(parsed.choices[0].message.parsed, Module)

    text, finish = "", None
    for chunk in client.chat.completions.create(
            model="tiny", messages=messages, temperature=1.0, max_completion_tokens=MAX_TOKENS, stream=True,
            response_format={"type": "json_schema", "json_schema": {"name": "items", "schema": SCHEMAS[1]}}):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMAS[1])

    completion = client.completions.create(model="tiny", prompt="config = ", max_tokens=MAX_TOKENS, temperature=0.0,
                                           extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                               "name": "status", "schema": SCHEMAS[2]}}})
    jsonschema.validate(json.loads(completion.choices[0].text), SCHEMAS[2])
    server.wait_idle()


def test_structured_outputs_and_guided_fields(served):
    server, client = served
    ask = dict(model="tiny", prompt="answer = ", max_tokens=32, temperature=1.0, n=3)
    choice = client.completions.create(**ask, extra_body={"structured_outputs": {"choice": CHOICES}})
    assert all(c.text in CHOICES and c.finish_reason == "stop" for c in choice.choices)
    regex = client.completions.create(**ask, extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    assert all(re.fullmatch("[0-9]{3}-[a-z]{2}", c.text) for c in regex.choices)
    grammar = client.completions.create(**ask, extra_body={"guided_grammar": 'root ::= "x" [0-9] | "y"'})
    assert all(re.fullmatch("x[0-9]|y", c.text) for c in grammar.choices)
    guided = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_completion_tokens=MAX_TOKENS, extra_body={"guided_json": SCHEMAS[0]})
    jsonschema.validate(json.loads(guided.choices[0].message.content), SCHEMAS[0])
    plain = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_completion_tokens=MAX_TOKENS, temperature=0.0,
                                           response_format={"type": "json_object"})
    if plain.choices[0].finish_reason == "stop":  # any object: it may be cut short at max_tokens
        assert isinstance(json.loads(plain.choices[0].message.content), dict)
    else:
        assert plain.choices[0].message.content.startswith("{")
    server.wait_idle()


@pytest.mark.parametrize("extra, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", 'Unsupported type "nonsense"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "needs json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format", ""),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "parenthesis is not closed"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_grammar": "root ::= foo"}, "guided_grammar", 'Rule "foo" is not defined'),
    ({"guided_choice": []}, "guided_choice", "at least one"),
    ({"guided_json": "{nope"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex", "give one"),
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens", "must be 0 with structured outputs"),
])
def test_bad_constraints_are_400s_naming_the_param(served, extra, param, message):
    import openai
    server, client = served
    for call in (lambda: client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra),
                 lambda: client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                        max_completion_tokens=4, extra_body=extra)):
        with pytest.raises(openai.BadRequestError) as error:
            call()
        body = error.value.body
        assert error.value.status_code == 400 and body["param"] == param and message in body["message"], body
