import dataclasses
import math
import random

import pytest
import torch
from scipy.stats import chisquare

from moespec.sampling import (
    Sampler,
    SamplingBatch,
    SamplingParams,
    apply_penalties,
    compute_logprobs,
    compute_probs,
    draw_uniform,
    invert_cdf,
    keyed_uniforms,
    mix32,
    mix32_tensor,
    sample,
    seed_key,
)
from moespec.sampling import UNIFORM_STREAM

EOS = 0


def build(params, logits, prompts=None, outputs=None, shared=None):
    N, V = logits.shape
    return SamplingBatch.build(
        params,
        prompts if prompts is not None else [[] for _ in range(N)],
        outputs if outputs is not None else [[] for _ in range(N)],
        V, "cpu", eos_token_ids=[EOS], shared_generator=shared)


def probs_of(params, logits, **kw):
    return compute_probs(logits, build(params, logits, **kw))


def random_logits(N, V, seed=0):
    return torch.randn(N, V, generator=torch.Generator().manual_seed(seed)) * 2


# --- SamplingParams ---------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [
    ("n", 0), ("max_tokens", 0), ("min_tokens", -1), ("temperature", -0.1), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("repetition_penalty", 0.0), ("logit_bias", {3: 101.0}),
    ("logit_bias", {-1: 1.0}), ("stop", [""]), ("stop_token_ids", [-1]), ("logprobs", 21),
])
def test_invalid_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_params_normalize_to_tuples_and_hash():
    p = SamplingParams(stop="END", stop_token_ids=[7, 9], logit_bias={"5": 1})
    assert p.stop == ("END",) and p.stop_token_ids == (7, 9) and p.logit_bias == {5: 1.0}
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert hash(p) == hash(SamplingParams(stop=("END",), stop_token_ids=(7, 9), logit_bias={5: 1.0}))
    with pytest.raises(AttributeError):
        p.temperature = 0.5  # type: ignore[misc]


def test_greedy_property():
    assert SamplingParams(temperature=0).greedy and SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy


# --- greedy and the cheap common case ---------------------------------------------------------

def test_greedy_is_argmax_and_top_k_1_is_greedy():
    logits = random_logits(6, 50)
    logits[0, [3, 7]] = 100.0  # a tie goes to the lowest id
    for params in ([SamplingParams(temperature=0)] * 6, [SamplingParams(top_k=1, seed=s) for s in range(6)]):
        batch = build(params, logits)
        probs = compute_probs(logits, batch)
        tokens = sample(probs, batch)
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 50).float())
        assert torch.equal(tokens, logits.argmax(-1)) and tokens[0] == 3


def test_greedy_rows_mixed_with_random_rows():
    logits = random_logits(4, 30)
    params = [SamplingParams(temperature=0), SamplingParams(seed=1), SamplingParams(top_k=1), SamplingParams()]
    batch = build(params, logits)
    tokens = sample(compute_probs(logits, batch), batch)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_default_params_build_no_vocab_sized_tensors():
    logits = random_logits(3, 40)
    batch = build([SamplingParams()] * 3, logits, prompts=[[1, 2]] * 3, outputs=[[3]] * 3)
    skipped = [batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seen, batch.output_counts,
               batch.logit_bias, batch.banned, batch.greedy]
    assert all(t is None for t in skipped)
    assert torch.allclose(compute_probs(logits, batch), logits.softmax(-1))


# --- each transform against a direct computation ----------------------------------------------

def test_temperature():
    logits = random_logits(3, 40)
    temps = [0.3, 1.0, 2.5]
    probs = probs_of([SamplingParams(temperature=t) for t in temps], logits)
    for row, t in enumerate(temps):
        assert torch.allclose(probs[row], (logits[row] / t).softmax(-1), atol=1e-6)


def test_top_k():
    logits = random_logits(4, 20)
    ks = [2, 5, -1, 0]
    probs = probs_of([SamplingParams(top_k=k) for k in ks], logits)
    for row, k in enumerate(ks):
        keep = logits[row].argsort(descending=True)[:k if k > 0 else 20]
        expected = torch.zeros(20)
        expected[keep] = logits[row, keep].softmax(-1)
        assert torch.allclose(probs[row], expected, atol=1e-6)


def test_top_p_keeps_the_token_crossing_the_threshold():
    # probabilities 0.5, 0.3, 0.15, 0.05 (ids permuted): 0.75 needs the 0.3 token to cross it.
    base = torch.tensor([0.15, 0.5, 0.05, 0.3]).log()
    logits = base.repeat(3, 1)
    probs = probs_of([SamplingParams(top_p=p) for p in (0.75, 0.85, 0.4)], logits)
    assert torch.allclose(probs[0], torch.tensor([0, 0.5, 0, 0.3]) / 0.8, atol=1e-6)
    assert torch.allclose(probs[1], torch.tensor([0.15, 0.5, 0, 0.3]) / 0.95, atol=1e-6)
    assert torch.allclose(probs[2], torch.tensor([0.0, 1.0, 0.0, 0.0]), atol=1e-6)


def test_top_p_against_direct_loop():
    logits = random_logits(5, 30, seed=3)
    top_ps = [0.1, 0.5, 0.7, 0.9, 0.99]
    probs = probs_of([SamplingParams(top_p=p) for p in top_ps], logits)
    for row, top_p in enumerate(top_ps):
        assert torch.allclose(probs[row], torch.tensor(reference_probs(logits[row].tolist(), top_p=top_p)),
                              atol=1e-5)


def test_min_p():
    logits = random_logits(3, 30, seed=4)
    min_ps = [0.05, 0.3, 0.9]
    probs = probs_of([SamplingParams(min_p=m) for m in min_ps], logits)
    for row, m in enumerate(min_ps):
        full = logits[row].softmax(-1)
        kept = torch.where(full >= m * full.max(), full, torch.zeros(()))
        assert torch.allclose(probs[row], kept / kept.sum(), atol=1e-6)
        assert (probs[row] == 0).any()


def test_repetition_penalty_divides_positive_multiplies_negative_on_prompt_and_output():
    logits = torch.tensor([[2.0, -1.0, 3.0, -2.0, 0.5]])
    params = [SamplingParams(repetition_penalty=2.0)]
    out = apply_penalties(logits, build(params, logits, prompts=[[0, 1]], outputs=[[2, 2]]))
    assert torch.allclose(out, torch.tensor([[1.0, -2.0, 1.5, -2.0, 0.5]]))


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.zeros(2, 5)
    params = [SamplingParams(frequency_penalty=0.5), SamplingParams(presence_penalty=0.7)]
    outputs = [[1, 1, 1, 3], [1, 1, 3]]
    out = apply_penalties(logits, build(params, logits, prompts=[[4, 4]] * 2, outputs=outputs))
    assert torch.allclose(out[0], torch.tensor([0, -1.5, 0, -0.5, 0]))
    assert torch.allclose(out[1], torch.tensor([0, -0.7, 0, -0.7, 0]))


def test_kept_token_counts_give_the_batch_its_lists_give():
    """Rows whose penalties read TokenCounts kept across steps (caught up step by step, then
    extended by a draft chain's tokens) build the same seen and count tensors as rows counting
    their lists; rows with other penalties, or none, stay zero in each."""
    from moespec.sampling import TokenCounts
    V, rng = 12, random.Random(0)
    params = [SamplingParams(repetition_penalty=1.3), SamplingParams(frequency_penalty=0.4),
              SamplingParams(presence_penalty=0.2, repetition_penalty=0.9), SamplingParams()]
    prompts = [[rng.randrange(V) for _ in range(rng.randint(0, 6))] for _ in params]
    outputs = [[] for _ in params]
    kept = [TokenCounts(prompt, V, "cpu") for prompt in prompts]
    for step in range(6):
        for out in outputs:
            out += [rng.randrange(V) for _ in range(rng.randint(0, 2))]
        for k, out in zip(kept, outputs):
            k.catch_up(out)
        drafts = [[rng.randrange(V) for _ in range(step % 3)] for _ in params]
        extended = [out + d for out, d in zip(outputs, drafts)]
        expected = SamplingBatch.build(params, prompts, extended, V, "cpu")
        got = SamplingBatch.build(params, prompts, extended, V, "cpu", counts=kept)
        assert torch.equal(got.seen, expected.seen) and torch.equal(got.output_counts, expected.output_counts)
        assert got.seen[[1, 3]].sum() == 0 and got.output_counts[[0, 3]].sum() == 0
    assert [k.num_outputs for k in kept] == [len(out) for out in outputs]
    with pytest.raises(ValueError, match="do not extend"):
        kept[0].catch_up(outputs[0][:-1] if outputs[0] else [-1])
    with pytest.raises(ValueError, match="fewer than its TokenCounts counted"):
        SamplingBatch.build(params, prompts, [[]] * 4, V, "cpu", counts=kept)


def test_logit_bias():
    logits = random_logits(2, 10)
    params = [SamplingParams(logit_bias={2: 5.0, 7: -100.0}), SamplingParams()]
    out = apply_penalties(logits, build(params, logits))
    expected = logits.clone()
    expected[0, 2] += 5.0
    expected[0, 7] -= 100.0
    assert torch.allclose(out, expected)
    with pytest.raises(ValueError, match="logit_bias"):
        build([SamplingParams(logit_bias={10: 1.0})], logits[:1])


def test_min_tokens_suppresses_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(4, 6)
    logits[:, EOS] = 50.0
    params = [SamplingParams(min_tokens=3, stop_token_ids=[4], temperature=0)] * 2 + [
        SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=[4]), SamplingParams(min_tokens=3)]
    outputs = [[1, 2], [1, 2, 3], [1], [1, 2, 3, 5]]
    batch = build(params, logits, outputs=outputs)
    out = apply_penalties(logits, batch)
    assert out[0, EOS] == -math.inf and out[0, 4] == -math.inf and torch.isfinite(out[0, 1:4]).all()
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])
    assert out[2, EOS] == 50.0 and out[2, 4] == -math.inf  # ignore_eos: EOS is not a stop token
    assert sample(compute_probs(logits, batch), batch)[0] != EOS


def test_penalties_do_not_modify_the_input_and_accept_bf16():
    logits = random_logits(1, 8).bfloat16()
    before = logits.clone()
    out = apply_penalties(logits, build([SamplingParams(repetition_penalty=1.5, logit_bias={1: 2.0})], logits,
                                        prompts=[[0, 1, 2]]))
    assert torch.equal(logits, before) and out.dtype == torch.float32


# --- seeds and uniforms ------------------------------------------------------------------------

def generate(target_row, mates, steps, logits):
    """Sample `steps` tokens for SamplingParams(seed=1234) placed at target_row among `mates`;
    each row's outputs grow by its own draws."""
    params = list(mates)
    params.insert(target_row, SamplingParams(seed=1234, temperature=1.2, top_p=0.95))
    shared = torch.Generator().manual_seed(len(mates))
    outputs = [[] for _ in params]
    for _ in range(steps):
        batch = build(params, logits[:len(params)], prompts=[[1, 2, 3]] * len(params), outputs=outputs, shared=shared)
        for row, token in enumerate(sample(compute_probs(logits[:len(params)], batch), batch).tolist()):
            outputs[row].append(token)
    return outputs[target_row]


def test_seeded_request_is_independent_of_batch_mates_and_position():
    row = random_logits(1, 50, seed=7)
    mates = [SamplingParams(seed=5), SamplingParams(), SamplingParams(temperature=0.5), SamplingParams(seed=99)]
    alone = generate(0, [], 12, row.repeat(5, 1))
    assert len(set(alone)) > 3  # each position draws with its own noise
    for position in (0, 2, 4):
        logits = random_logits(5, 50, seed=position)
        logits[position] = row
        assert generate(position, mates, 12, logits) == alone
    other_seed = SamplingParams(seed=4321, temperature=1.2, top_p=0.95)
    outputs = []
    for _ in range(12):
        batch = build([other_seed], row, prompts=[[1, 2, 3]], outputs=[outputs])
        outputs.append(int(sample(compute_probs(row, batch), batch)))
    assert outputs != alone


def test_keyed_hash_is_the_same_on_tensors_and_ints():
    values = [0, 1, 2**31, MASK := 2**32 - 1, 123456789, 0xDEADBEEF]
    assert mix32_tensor(torch.tensor(values)).tolist() == [mix32(v) for v in values]
    assert len({mix32(v) for v in range(100_000)}) == 100_000  # a bijection: no collisions
    assert seed_key(-1) != seed_key(2**32 - 1) and 0 <= seed_key(-2**63) <= MASK


def test_keyed_noise_is_the_hash_of_seed_position_and_column():
    """Every keyed uniform is the pure-integer mix32 of (row key, column), salted: the int32 words
    the tensors compute in give exactly these bits (pinned so seeded outputs never drift)."""
    from moespec.sampling import GUMBEL_STREAM, keyed_gumbel_max
    seeds, positions = torch.tensor([seed_key(7), seed_key(2**40 + 3)]), torch.tensor([0, 2**33 + 5])
    u = keyed_uniforms(seeds, positions, 3000, UNIFORM_STREAM)
    for r in range(2):
        row = mix32(int(seeds[r]) ^ mix32((int(positions[r]) & 0xFFFFFFFF) ^ UNIFORM_STREAM))
        salt = mix32(row ^ 0x68E31DA4)
        for c in (0, 1, 1234, 2999):
            bits = mix32((mix32(row ^ c) + salt) & 0xFFFFFFFF)
            assert u[r, c].item() == (bits + 0.5) * 2.0 ** -32
    # the Gumbel race runs over blocks of columns: the same token as over the whole row at once
    probs = torch.softmax(torch.randn(3, 200_000, generator=torch.Generator().manual_seed(0)) * 4, -1)
    keys, where = torch.tensor([seed_key(s) for s in (1, 2, 3)]), torch.tensor([10, 11, 12])
    race = probs.double() / -keyed_uniforms(keys, where, probs.shape[1], GUMBEL_STREAM).log()
    assert torch.equal(keyed_gumbel_max(probs, keys, where), race.argmax(-1))


def test_draw_uniform_keys_seeded_rows_by_seed_and_position():
    params = [SamplingParams(seed=3), SamplingParams(), SamplingParams(seed=8), SamplingParams(temperature=0, seed=4)]
    batch = build(params, torch.zeros(4, 4), outputs=[[1] * 5, [], [2] * 9, []], shared=torch.Generator().manual_seed(0))
    u = draw_uniform(batch, 5)
    assert u.shape == (4, 5) and ((u >= 0) & (u < 1)).all() and (u[3] == 0).all()  # greedy rows need none
    for row, seed, position in ((0, 3, 5), (2, 8, 9)):
        expected = keyed_uniforms(torch.tensor([seed_key(seed)]), torch.tensor([position]), 5, UNIFORM_STREAM)[0]
        assert torch.equal(u[row], expected)
    again = draw_uniform(build(params[2:3], torch.zeros(1, 4), outputs=[[7] * 9]), 5)
    assert torch.equal(again[0], u[2])  # alone, with other outputs of the same length: the same noise
    assert not torch.equal(draw_uniform(build(params[2:3], torch.zeros(1, 4), outputs=[[7] * 10]), 5)[0], u[2])


def test_invert_cdf_never_picks_zero_probability_tokens():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).repeat(4, 1)
    uniforms = torch.tensor([0.0, 0.5 - 1e-12, 0.5, 1 - 2 ** -53], dtype=torch.float64)
    assert invert_cdf(probs, uniforms).tolist() == [1, 1, 3, 3]


# --- distribution: chi-square goodness of fit --------------------------------------------------

CHI_LOGITS = [2.0, 1.5, 1.2, 0.8, 0.3, 0.0, -0.5, -1.5]


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Straightforward per-token implementation of temperature -> top-k -> top-p -> min-p."""
    z = [x / temperature for x in logits]
    e = [math.exp(x - max(z)) for x in z]
    p = [x / sum(e) for x in e]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(p[i] for i in kept)
    nucleus, before = [], 0.0
    for i in kept:
        if before >= top_p:
            break
        nucleus.append(i)
        before += p[i] / mass
    best = max(p[i] for i in nucleus)
    final = [i for i in nucleus if p[i] >= min_p * best]
    total = sum(p[i] for i in final)
    return [p[i] / total if i in final else 0.0 for i in range(len(p))]


def expected_counts(probs, draws):
    return (probs / probs.sum() * draws).numpy()  # sums to `draws` exactly enough for scipy's check


CHI_CONFIGS = [
    dict(temperature=0.7),
    dict(top_k=3),
    dict(top_p=0.8),
    dict(temperature=1.5, min_p=0.2),
    dict(temperature=0.9, top_k=5, top_p=0.9, min_p=0.3),
]


@pytest.mark.parametrize("config", CHI_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("keys", ["shared-generator", "per-row-seeds", "one-seed-many-positions"])
def test_samples_follow_the_reference_distribution(config, keys):
    draws = 20_000
    logits = torch.tensor(CHI_LOGITS).repeat(draws, 1)
    seeds = {"shared-generator": [None] * draws, "per-row-seeds": list(range(draws)),
             "one-seed-many-positions": [2**40 + 7] * draws}[keys]
    params = [SamplingParams(**config, seed=s) for s in seeds]
    batch = build(params, logits, shared=torch.Generator().manual_seed(0))
    if keys == "one-seed-many-positions":  # row i draws the token at position i
        batch = dataclasses.replace(batch, positions=torch.arange(draws))
    probs = compute_probs(logits, batch)
    expected = torch.tensor(reference_probs(CHI_LOGITS, **config), dtype=torch.float64)
    assert torch.allclose(probs[0], expected.float(), atol=1e-6)
    counts = torch.bincount(sample(probs, batch), minlength=len(CHI_LOGITS)).double()
    support = expected > 0
    assert counts[~support].sum() == 0, "a token with probability 0 was drawn"
    p_value = chisquare(counts[support].numpy(), expected_counts(expected[support], draws)).pvalue
    assert p_value > 1e-3, f"{config}: p={p_value:.2g}, counts={counts.tolist()}"


def test_chi_square_detects_a_wrong_distribution():
    logits = torch.tensor(CHI_LOGITS).repeat(20_000, 1)
    batch = build([SamplingParams(temperature=0.7)] * 20_000, logits, shared=torch.Generator().manual_seed(0))
    counts = torch.bincount(sample(compute_probs(logits, batch), batch), minlength=8).double().numpy()
    untempered = expected_counts(torch.tensor(reference_probs(CHI_LOGITS), dtype=torch.float64), 20_000)
    assert chisquare(counts, untempered).pvalue < 1e-6


# --- logprobs ----------------------------------------------------------------------------------

def test_compute_logprobs_are_raw_log_softmax_sorted():
    logits = random_logits(4, 30)
    tokens = torch.tensor([0, 5, 29, 7])
    token_lp, top_ids, top_lps = compute_logprobs(logits, tokens, 5)
    reference = torch.log_softmax(logits, -1)
    assert torch.allclose(token_lp, reference[torch.arange(4), tokens])
    assert torch.equal(top_ids, reference.argsort(-1, descending=True)[:, :5])
    assert torch.allclose(top_lps, reference.gather(1, top_ids)) and (top_lps.diff(dim=-1) <= 0).all()
    assert top_lps.dtype == torch.float32


def test_sampler_returns_logprobs_only_for_rows_that_asked():
    logits = random_logits(3, 30)
    params = [SamplingParams(logprobs=3, temperature=0.5, repetition_penalty=1.5),
              SamplingParams(seed=2), SamplingParams(logprobs=0, seed=3)]
    batch = build(params, logits, prompts=[[1, 2, 3]] * 3)
    out = Sampler()(logits, batch)
    assert out.tokens.shape == (3,) and out.tokens.dtype == torch.int64 and out.logprobs[1] is None
    raw = torch.log_softmax(logits, -1)
    first, last = out.logprobs[0], out.logprobs[2]
    assert first.logprob == pytest.approx(raw[0, out.tokens[0]].item(), abs=1e-6)
    assert first.top_ids == raw[0].argsort(descending=True)[:3].tolist()
    assert first.top_logprobs == pytest.approx(raw[0].sort(descending=True).values[:3].tolist(), abs=1e-6)
    assert last.logprob == pytest.approx(raw[2, out.tokens[2]].item(), abs=1e-6) and last.top_ids == []


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=5e-324), SamplingParams(temperature=1e-4), SamplingParams(top_p=5e-324),
    SamplingParams(repetition_penalty=5e-324), SamplingParams(repetition_penalty=1e30, temperature=1e-4),
    SamplingParams(min_p=1.0, top_p=1e-30, seed=3),
], ids=["tiny-temperature", "small-temperature", "tiny-top-p", "tiny-penalty", "huge-penalty", "extremes-seeded"])
def test_extreme_parameters_still_sample_real_tokens(params):
    """Overflow in a transform must not turn a row into NaN (whose draw would be a token id
    outside the vocabulary): the row stays a distribution."""
    logits = random_logits(4, 30, seed=9) * 30
    batch = build([params] * 4, logits, prompts=[[1, 2, 3, 4, 5]] * 4)
    probs = compute_probs(logits, batch)
    assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(4))
    tokens = sample(probs, batch)
    assert ((tokens >= 0) & (tokens < 30)).all()
    assert (probs.gather(1, tokens[:, None]) > 0).all()


@pytest.mark.parametrize("params", [SamplingParams(repetition_penalty=4e307), SamplingParams(min_tokens=5)],
                         ids=["penalty-overflows-to-minus-inf", "min-tokens-holds-back-the-only-token"])
def test_a_grammar_row_whose_allowed_tokens_are_impossible_stays_a_distribution(params):
    """A grammar allowing only token 3 (the EOS), which the prompt made a huge penalty push to
    -inf, or which min_tokens holds back: the row samples token 3, not NaN (whose draw would be
    an id outside the vocabulary)."""
    logits = -random_logits(2, 30, seed=4).abs() - 1  # every logit negative: a penalty multiplies
    batch = SamplingBatch.build([params] * 2, [[3, 7]] * 2, [[]] * 2, 30, torch.device("cpu"), eos_token_ids=(3,))
    batch = batch.constrained(torch.tensor([[1 << 3]] * 2, dtype=torch.int32), 30)
    probs = compute_probs(logits, batch)
    assert torch.isfinite(probs).all() and (probs[:, 3] == 1).all()
    assert sample(probs, batch).tolist() == [3, 3]
