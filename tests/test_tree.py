"""Draft trees: expansion and reranking against a brute-force reference, the walk down the tree,
KV compaction, and through the engine greedy identity with every drafter, lossless sampling
(chi-square), logprobs and penalties, and the policy's choice of trees."""
import pytest
import torch

from moespec import LLM, SamplingParams
from moespec.attention.base import LayerKV
from moespec.config import ConfigError, build_config
from moespec.speculation.tree import DraftTree, TreeShape, compact_path, grow_tree, walk_tree
from reference import exact_joint, joint_pvalue
from test_speculation import GREEDY, MIXED, generate, prompts

V = 11


def fake_logprobs(path: tuple[int, ...]) -> torch.Tensor:
    """A drafter whose distribution after a path of tokens is a fixed function of the path [V]."""
    gen = torch.Generator().manual_seed(hash(path) % (2 ** 31))
    return (torch.randn(V, generator=gen) * 2).log_softmax(-1)


def grow_fake(shape: TreeShape, roots: list[tuple[int, ...]]) -> tuple[DraftTree, list]:
    """grow_tree over the fake drafter, checking what each frontier forward is given."""
    calls = []
    paths = [{} for _ in roots]  # per request: frontier slot -> path of tokens

    def forward(level, tokens, parent, visible):
        K = shape.top_k
        out = torch.empty(len(roots), K, V)
        for b in range(len(roots)):
            for j in range(K):
                prev = paths[b].get((level - 2) * K + parent[b, j].item(), ()) if level > 1 else ()
                path = prev + (tokens[b, j].item(),)
                paths[b][(level - 1) * K + j] = path
                # node j sees exactly its ancestors' slots and its own
                seen = {s for s in range(level * K) if visible[b, j, s]}
                assert seen == {s for s, p in paths[b].items() if s < level * K and path[:len(p)] == p}
                out[b, j] = fake_logprobs(roots[b] + path)
        calls.append(level)
        return out

    tree = grow_tree(shape, torch.stack([fake_logprobs(r) for r in roots]), forward)
    return tree, calls


def brute_force(shape: TreeShape, root: tuple[int, ...]) -> set[tuple[int, ...]]:
    """The same expansion and reranking written out over explicit paths."""
    K = shape.top_k

    def children(path):
        lp = fake_logprobs(root + path).double().clamp(min=-1e4)
        values, ids = lp.topk(K)
        return [(path + (t,), v) for t, v in zip(ids.tolist(), values.tolist())]

    score = {}
    chain = [children(())[0][0]]
    frontier = children(())
    score.update(frontier)
    for _ in range(shape.depth - 1):
        level = [(p, score[p[:-1]] + v) for parent, _ in frontier for p, v in children(parent)]
        score.update(level)
        chain.append(children(chain[-1])[0][0])
        on_chain = lambda p: p in chain  # noqa: E731
        frontier = sorted(level, key=lambda pv: (not on_chain(pv[0]), -pv[1]))[:K]
    ranked = sorted(score, key=lambda p: (p not in chain, -(score[p] - 1e-6 * len(p))))
    return set(ranked[:shape.num_draft_tokens])


def tree_paths(tree: DraftTree, b: int) -> list[tuple[int, ...]]:
    paths = [()]
    for token, parent in zip(tree.tokens[b].tolist(), tree.parents[b].tolist()):
        paths.append(paths[parent] + (token,))
    return paths[1:]


@pytest.mark.parametrize("shape", [TreeShape(2, 3, 5), TreeShape(3, 3, 8), TreeShape(4, 2, 8), TreeShape(1, 4, 4)])
def test_grown_tree_matches_brute_force_expansion(shape):
    roots = [(1,), (2, 5), (7,)]
    tree, calls = grow_fake(shape, roots)
    assert calls == list(range(1, shape.depth))
    assert tree.tokens.shape == (3, shape.num_draft_tokens)
    for b, root in enumerate(roots):
        paths = tree_paths(tree, b)
        assert set(paths) == brute_force(shape, root)
        parents = tree.parents[b].tolist()
        assert all(p < i + 1 for i, p in enumerate(parents))  # breadth-first: parents come first
        assert tree.depths[b].tolist() == [len(p) for p in paths]
    # every node with children was run by the drafter (it has a slot); the last level never was
    slots = torch.cat([torch.zeros_like(tree.draft_slots[:, :1]), tree.draft_slots], 1)  # the root: no slot needed
    assert (slots.gather(1, tree.parents) >= 0).all()
    assert (tree.depths[tree.draft_slots >= 0] < shape.depth).all()
    anc = tree.ancestors()
    for i, path in enumerate(tree_paths(tree, 0), start=1):
        seen = {j for j in range(1, shape.num_draft_tokens + 1) if anc[0, i, j]}
        assert seen == {j for j, p in enumerate(tree_paths(tree, 0), start=1) if path[:len(p)] == p}
        assert anc[0, i, 0]


def test_tree_holds_the_chain_of_top1_drafts():
    shape = TreeShape(3, 4, 4)  # as many nodes as the depth: exactly the chain
    tree, _ = grow_fake(shape, [(4,)])
    chain, path = [], (4,)
    for _ in range(4):
        token = fake_logprobs(path).argmax().item()
        chain.append(token)
        path += (token,)
    assert tree_paths(tree, 0)[-1] == tuple(chain)


def test_walk_follows_the_target_down_the_tree():
    # root -> a(1) -> c(3); root -> b(2) -> d(4), e(5)
    tree = DraftTree(tokens=torch.tensor([[1, 2, 3, 4, 5]] * 3), parents=torch.tensor([[0, 0, 1, 2, 2]] * 3),
                     depths=torch.tensor([[1, 1, 2, 2, 2]] * 3), draft_slots=torch.full((3, 5), -1), depth=2)
    draws = torch.tensor([[2, 9, 5, 9, 9, 8],  # root->b, b draws 5 -> e, e draws 8 (bonus)
                          [1, 7, 9, 9, 9, 9],  # root->a, a draws 7: no child carries it
                          [6, 1, 1, 1, 1, 1]])  # the root's draw 6 is in no child
    result = walk_tree(draws, tree)
    assert result.num_accepted.tolist() == [2, 1, 0]
    assert result.path.tolist() == [[0, 2, 5], [0, 1, 1], [0, 0, 0]]
    assert result.tokens[0].tolist() == [2, 5, 8]
    assert result.tokens[1, :2].tolist() == [1, 7] and result.tokens[2, 0].item() == 6


def test_compaction_moves_the_path_and_reads_before_writing():
    S = 4
    k = torch.arange(3 * S, dtype=torch.float32).view(3, S, 1, 1)  # 3 pages of 4
    layer = LayerKV(k.clone(), k.clone() + 100)
    pages = torch.tensor([[2, 0, 1]])  # positions 0-3 on page 2, 4-7 on page 0, 8-11 on page 1
    compact_path([layer], pages, S, torch.tensor([[3, 5, 6, 9]]), torch.tensor([[3, 4, 5, 6]]))
    flat = lambda t: t.view(-1).tolist()  # noqa: E731
    row = lambda pos: pages[0, pos // S].item() * S + pos % S  # noqa: E731
    before = flat(k)
    assert [flat(layer.k)[row(p)] for p in (3, 4, 5, 6)] == [before[row(p)] for p in (3, 5, 6, 9)]
    assert flat(layer.v)[row(5)] == before[row(6)] + 100  # 5 took 6's, though 6 was itself overwritten


def test_tree_shapes_and_config_errors():
    assert TreeShape.parse("4x3x8") == TreeShape(4, 3, 8) and TreeShape(4, 3, 8).label == "4x3x8"
    assert TreeShape(4, 3, 8).lookahead == 9 and TreeShape(4, 4, 8).lookahead == 13
    with pytest.raises(ValueError, match="num_draft_tokens 7 exceeds the 6 candidates"):
        TreeShape(2, 2, 7)
    base = {"model": {"path": "x"}, "speculation": {"mode": "mtp", "num_speculative_tokens": 2}}
    for tree, message in (({"top_k": 2, "depth": 2}, "needs num_draft_tokens"),
                          ({"top_k": 2, "depth": 2, "num_draft_tokens": 3, "width": 1}, "unknown key speculation.tree.width"),
                          ({"top_k": 0, "depth": 2, "num_draft_tokens": 3}, "speculation.tree.top_k must be a positive"),
                          ("wide", "speculation.tree")):
        with pytest.raises(ConfigError, match=message):
            build_config(base, {"speculation.tree": tree})
    with pytest.raises(ConfigError, match="not supported with speculation.acceptance: relaxed"):
        build_config(base, {"speculation.tree": "auto", "speculation.acceptance": "relaxed"})
    with pytest.raises(ConfigError, match="speculation.tree.depth 3 exceeds speculation.num_speculative_tokens 2"):
        build_config(base, {"speculation.tree": {"top_k": 2, "depth": 3, "num_draft_tokens": 4}})


def tree_spec(mode, tree, **extra):
    """A fixed tree (adaptive off), drafting as deep as the tree."""
    return {"mode": mode, "num_speculative_tokens": tree["depth"], "adaptive": False, "tree": tree, **extra}


@pytest.mark.parametrize("tree", [{"top_k": 2, "depth": 3, "num_draft_tokens": 5},
                                  {"top_k": 4, "depth": 2, "num_draft_tokens": 8}], ids=["2x3x5", "4x2x8"])
def test_mtp_tree_greedy_identical_in_mixed_batches(deepseek_mtp, tree):
    """More requests than slots: prefill chunks share steps with decoding requests, the MTP layer
    catches up, trees verify at several lengths."""
    batch = prompts([5, 23, 9, 17], seed=5) + MIXED
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 7, 1, 19, 24, 2, 13, 24)]
    ref, _ = generate(deepseek_mtp, None, batch, params, max_num_seqs=3)
    got, llm = generate(deepseek_mtp, tree_spec("mtp", tree), batch, params, max_num_seqs=3)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    label = f"{tree['top_k']}x{tree['depth']}x{tree['num_draft_tokens']}"
    assert list(llm.engine.spec_stats.by_tree) == [label] and llm.engine.spec_stats.by_tree[label][0] > 0
    from moespec.server.metrics import ServerMetrics
    metrics = ServerMetrics()
    metrics.observe_engine(llm.engine)
    assert f'moespec_spec_tree_accept_length{{shape="{label}"}}' in metrics.render().decode()


def test_draft_model_and_external_head_trees_greedy_identical(llama_pair, tmp_path):
    from tiny_models import save_random_mtp_head
    target, draft = llama_pair
    head = save_random_mtp_head(target, tmp_path / "head")
    batch = prompts([5, 23, 9], seed=8) + MIXED[:2]
    ref, _ = generate(target, None, batch, GREEDY)
    tree = {"top_k": 3, "depth": 3, "num_draft_tokens": 6}
    for spec in (tree_spec("draft", tree, draft_model=draft), tree_spec("mtp", tree, mtp_head=head)):
        got, llm = generate(target, spec, batch, GREEDY, max_num_seqs=3)
        assert [o.token_ids for o in got] == [o.token_ids for o in ref], spec["mode"]
        assert llm.engine.spec_stats.by_tree["3x3x6"][0] > 0


def test_identical_draft_tree_accepts_its_whole_depth(llama_pair):
    """The drafter's KV of accepted nodes moves with them: a draft equal to the target keeps
    accepting the full depth step after step."""
    target, _ = llama_pair
    spec = tree_spec("draft", {"top_k": 3, "depth": 3, "num_draft_tokens": 6}, draft_model=target)
    got, llm = generate(target, spec, prompts([6, 9], seed=2), SamplingParams(temperature=0.0, max_tokens=33,
                                                                                ignore_eos=True))
    assert llm.engine.spec_stats.tree_accept_lengths() == {"3x3x6": pytest.approx(4.0)}


def test_tree_under_preemption_stops_and_max_len(deepseek_mtp, llama_pair):
    batch = prompts([7, 13, 21, 4, 11, 16], seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    ref, _ = generate(deepseek_mtp, None, batch, params, max_model_len=40)
    spec = tree_spec("mtp", {"top_k": 2, "depth": 2, "num_draft_tokens": 4})
    got, _ = generate(deepseek_mtp, spec, batch, params, num_kv_pages=18, max_num_batched_tokens=32, max_model_len=40)
    assert sum(o.metrics.num_preemptions for o in got) > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert any(o.finish_reason == "length" and len(o.prompt_token_ids) + len(o.token_ids) == 40 for o in got)
    target, _ = llama_pair  # a stop token inside an accepted path truncates exactly there
    free, _ = generate(target, None, batch[:1], params)
    stop = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[free[0].token_ids[6]])
    ref, _ = generate(target, None, batch[:1], stop)
    got, _ = generate(target, tree_spec("draft", {"top_k": 2, "depth": 4, "num_draft_tokens": 6},
                                        draft_model=target), batch[:1], stop)
    assert got[0].token_ids == ref[0].token_ids and got[0].finish_reason == "stop"


def test_tree_logprobs_penalties_and_seeds_agree_with_no_speculation(deepseek_mtp):
    batch = prompts([8, 15], seed=4)
    spec = tree_spec("mtp", {"top_k": 3, "depth": 2, "num_draft_tokens": 5})
    for params in (SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2,
                                  repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
                   SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, logprobs=1, seed=11,
                                  frequency_penalty=0.4, min_tokens=5),
                   SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True, logprobs=1, seed=5)):
        ref, _ = generate(deepseek_mtp, None, batch, params)
        got, llm = generate(deepseek_mtp, spec, batch, params)
        assert llm.engine.spec_stats.by_tree["3x2x5"][0] > 0
        for r, g in zip(ref, got):
            assert g.token_ids == r.token_ids
            for a, b in zip(r.logprobs, g.logprobs):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4
                assert list(a.top) == list(b.top)


@pytest.mark.parametrize("mode", ["mtp", "draft"])
def test_tree_sampling_follows_the_target_distribution(deepseek_mtp, llama_pair, mode):
    """Unseeded random rows over the first 3 tokens: the walk's draws with one uniform per depth.
    The draft model is the target itself, its tree two wide: a third of the target's top-3
    draws fall outside it."""
    path = deepseek_mtp if mode == "mtp" else llama_pair[0]
    extra = {"draft_model": llama_pair[0]} if mode == "draft" else {}
    spec = tree_spec(mode, {"top_k": 2, "depth": 2, "num_draft_tokens": 4}, **extra)
    prompt = prompts([6], seed=7)[0]
    base = SamplingParams(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True)
    joint = exact_joint(path, prompt, base, 3)
    n = 1500
    llm = LLM(model=path, speculation=spec, page_size=4, num_kv_pages=2048, max_num_seqs=512)
    outs = llm.generate([prompt] * n, base, use_tqdm=False)
    stats = llm.engine.spec_stats
    assert stats.by_tree["2x2x4"][0] > 0 and 0 < stats.accepted_tokens < 2 * stats.by_tree["2x2x4"][0]
    assert joint_pvalue(joint, [o.token_ids for o in outs]) > 1e-3  # and nothing outside its support


def test_policy_measures_trees_next_to_chains():
    from moespec.speculation.adaptive import SpeculationPolicy
    tree = TreeShape(2, 2, 4)

    def run(batch, costs, steps):
        policy = SpeculationPolicy(2, adaptive=True, trees=(tree,))
        choices = []
        for _ in range(steps):
            choice = policy.choose(batch)
            choices.append(choice)
            policy.record(batch, choice, *costs[choice])
        return policy, choices

    policy, choices = run(1, {tree: (2.6, 0.012), 2: (2.2, 0.012), 1: (1.7, 0.011), 0: (1.0, 0.010)}, 100)
    assert policy.candidates(2) == [tree, 2, 1, 0]
    assert choices[:8] == [tree, tree, 2, 2, 1, 1, 0, 0] and choices[8:].count(tree) >= 0.97 * 92
    assert policy.leaders[1] == tree
    # at a batch size where nothing pays, plain decoding
    policy, choices = run(64, {tree: (1.3, 0.030), 2: (1.2, 0.020), 1: (1.1, 0.016), 0: (1.0, 0.010)}, 100)
    assert choices[8:] == [0] * 92 and policy.leaders[64] == 0
    assert SpeculationPolicy(2, adaptive=False, trees=(tree,)).choose(4) == tree


def test_auto_trees_run_and_stay_exact(deepseek_mtp):
    batch = prompts([5, 9, 12], seed=6)
    ref, _ = generate(deepseek_mtp, None, batch, GREEDY)
    spec = {"mode": "mtp", "num_speculative_tokens": 2, "adaptive": True, "tree": "auto"}
    got, llm = generate(deepseek_mtp, spec, batch, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert set(llm.engine.spec_stats.by_tree) == {"2x2x4", "4x2x8"}  # both measured


def test_bench_tree_modes_parse():
    from moespec.bench import parse_mode
    assert parse_mode("mtp-tree:4x3x8")[1] == {"mode": "mtp", "num_speculative_tokens": 3,
                                               "tree": {"top_k": 4, "depth": 3, "num_draft_tokens": 8}}
    assert parse_mode("draft-tree:auto")[1] == {"mode": "draft", "tree": "auto", "adaptive": True}
    assert parse_mode("mtp:2")[1] == {"mode": "mtp", "tree": None, "num_speculative_tokens": 2}
    assert parse_mode("mtp:plain")[1] == {"mode": "mtp", "tree": None, "schedule": {1: 0}, "adaptive": False}
    with pytest.raises(ValueError, match="TOPKxDEPTHxTOKENS"):
        parse_mode("mtp-tree:4x3")


def test_bench_runs_a_mode_twice_only_under_a_tag():
    from moespec.bench import parse_modes
    assert parse_modes("none,mtp:2@b,none@again") == [
        ("none", {"mode": "none", "tree": None}), ("mtp:2@b", {"mode": "mtp", "tree": None, "num_speculative_tokens": 2}),
        ("none@again", {"mode": "none", "tree": None})]
    with pytest.raises(ValueError, match="none given twice"):
        parse_modes("none,mtp,none")
    with pytest.raises(ValueError, match="'mtp@'.*empty"):
        parse_modes("mtp@")
    with pytest.raises(ValueError, match="'nope' is not a mode"):
        parse_modes("nope@x")
