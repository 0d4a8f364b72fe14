"""An MTP head drafting over a reduced vocabulary (the N ids of its `draft_vocab`): its logits are
the lm_head rows of those tokens, every other token has draft probability 0, and speculation
stays lossless (greedy identity, and sampling that follows the target's distribution)."""
import pytest
import torch

from moespec import LLM, SamplingParams
from moespec.models import load_model
from moespec.models.mtp_head import OUTSIDE_DRAFT_VOCAB, load_mtp_head
from reference import exact_joint, joint_pvalue
from test_speculation import GREEDY, MIXED, generate, prompts
from tiny_models import save_random_mtp_head

DRAFT_VOCAB = list(range(0, 120, 3))  # 40 of the tiny target's 120 tokens


@pytest.fixture(scope="module")
def reduced_head(llama_pair, tmp_path_factory):
    return save_random_mtp_head(llama_pair[0], tmp_path_factory.mktemp("head"), "rmsnorm", DRAFT_VOCAB)


def test_draft_logits_are_the_draft_rows_and_nothing_else(llama_pair, reduced_head):
    target = load_model(llama_pair[0], show_progress=False)
    drafter = load_mtp_head(target, reduced_head)
    assert drafter.head.draft_vocab.dtype == torch.int64 and drafter.head.draft_vocab.tolist() == DRAFT_VOCAB
    hidden = torch.randn(5, target.config.hidden_size)
    logits = drafter.compute_mtp_logits(0, hidden)  # [5, V]
    full = target.compute_logits(hidden)
    inside = torch.tensor(DRAFT_VOCAB)
    torch.testing.assert_close(logits[:, inside], full[:, inside])
    outside = torch.ones(logits.shape[1], dtype=torch.bool).index_fill_(0, inside, False)
    assert (logits[:, outside] == OUTSIDE_DRAFT_VOCAB).all()
    assert (torch.softmax(logits, -1)[:, outside] == 0).all()  # draft probability exactly 0
    masked = logits.index_fill(1, inside, float("-inf"))  # a grammar allowing no draft token
    assert torch.softmax(masked, -1)[:, outside].sum(-1).allclose(torch.ones(5))  # still a distribution


def test_reduced_vocab_greedy_identical_to_no_speculation(llama_pair, reduced_head):
    batch = prompts([5, 23, 9], seed=8) + MIXED[:2]
    ref, _ = generate(llama_pair[0], None, batch, GREEDY)
    got, llm = generate(llama_pair[0], {"mode": "mtp", "mtp_head": reduced_head, "num_speculative_tokens": 2,
                                        "adaptive": False}, batch, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert llm.engine.spec_stats.steps > 0


def test_reduced_vocab_sampling_follows_the_target_distribution(llama_pair, reduced_head):
    """Tokens outside the draft vocabulary are never drafted, yet the outputs follow the target's
    exact joint distribution over three tokens, those tokens included (chi-square)."""
    path = llama_pair[0]
    prompt = prompts([6], seed=7)[0]
    base = SamplingParams(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True)
    joint = exact_joint(path, prompt, base, 3)
    n = 1500
    llm = LLM(model=path, speculation={"mode": "mtp", "mtp_head": reduced_head, "num_speculative_tokens": 2,
                                       "adaptive": False}, page_size=4, num_kv_pages=2048, max_num_seqs=512)
    outs = llm.generate([prompt] * n, [SamplingParams(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True,
                                                      seed=1000 + i) for i in range(n)], use_tqdm=False)
    stats = llm.engine.spec_stats
    assert stats.steps > 0 and 0 < stats.accepted_tokens < stats.draft_tokens
    emitted = {t for o in outs for t in o.outputs[0].token_ids}
    assert emitted - set(DRAFT_VOCAB), "the target's tokens outside the draft vocabulary still come out"
    assert joint_pvalue(joint, [o.outputs[0].token_ids for o in outs]) > 1e-3
