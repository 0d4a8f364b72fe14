"""Expert-parallel load balancing: the placement algorithm, its config, the load recorder,
redundant experts and live rebalancing (docs/expert-parallel.md, "EPLB")."""
import pytest
import torch

from moespec.config import ConfigError, build_config
from moespec.parallel.placement import (PlacementError, compute_placement, imbalance, pack_balanced, replicate,
                                        trivial_placement)


def skewed_load(num_layers: int, num_experts: int, seed: int = 0) -> torch.Tensor:
    """[Y, E] routed rows where the top 10% of experts take about half of them."""
    g = torch.Generator().manual_seed(seed)
    load = torch.rand(num_layers, num_experts, generator=g) * 100 + 50
    hot = max(1, num_experts // 10)
    for y in range(num_layers):
        top = torch.randperm(num_experts, generator=g)[:hot]
        load[y, top] = load[y].sum() / hot
    return load


@pytest.mark.parametrize("algorithm,groups,nodes", [("global", 1, 1), ("hierarchical", 4, 2), ("auto", 8, 2),
                                                    ("auto", 3, 2)])
def test_placement_covers_every_expert_with_equal_slots_per_rank(algorithm, groups, nodes):
    E, R, G = 24, 8, 4
    load = skewed_load(3, E)
    placement = compute_placement(load, R, G, num_groups=groups, num_nodes=nodes, algorithm=algorithm)
    assert placement.phys_to_log.shape == (3, E + R)
    counts = placement.replica_counts(E)
    assert bool((counts >= 1).all()) and bool((counts.sum(1) == E + R).all())
    table = placement.replica_table(E)  # every replica is listed once, at a slot holding its expert
    for y in range(3):
        for e in range(E):
            slots = table[y, e][table[y, e] >= 0]
            assert len(slots) == counts[y, e]
            assert bool((placement.phys_to_log[y, slots] == e).all())
    assert placement.slots_per_rank == (E + R) // G


def test_placement_reduces_imbalance_on_skewed_loads():
    E, G = 32, 4
    load = skewed_load(4, E, seed=1)
    before = imbalance(trivial_placement(4, E, 0, G).rank_loads(load))
    after = imbalance(compute_placement(load, 4, G, algorithm="global").rank_loads(load))
    assert float(before.max()) >= 0.5, before
    assert bool((after < before / 2).all()) and float(after.max()) <= 0.15, (before, after)


def test_hierarchical_keeps_a_group_on_one_node():
    E, G, groups, nodes = 16, 4, 4, 2
    load = skewed_load(1, E)
    placement = compute_placement(load, 4, G, num_groups=groups, num_nodes=nodes, algorithm="hierarchical")
    node_of_slot = placement.rank_of_slot() // (G // nodes)
    for group in range(groups):
        members = torch.arange(group * 4, group * 4 + 4)
        nodes_hit = {int(node_of_slot[s]) for s in range(E + 4) if int(placement.phys_to_log[0, s]) in members}
        assert len(nodes_hit) == 1


def test_replicate_and_pack_by_hand():
    assert replicate([10.0, 1.0, 4.0], 5) == [3, 1, 1]  # 10 -> 5 -> 3.33 per copy, still above 4
    assert pack_balanced([5.0, 4.0, 3.0, 3.0], 2) == [0, 1, 1, 0]
    with pytest.raises(PlacementError):
        pack_balanced([1.0, 2.0, 3.0], 2)
    with pytest.raises(PlacementError, match="hierarchical"):
        compute_placement(torch.ones(1, 12), 4, 4, num_groups=3, num_nodes=2, algorithm="hierarchical")


def test_eplb_config_defaults_off_and_nested_override():
    assert not build_config({"model": {"path": "m"}}).parallel.eplb.enabled
    config = build_config({"model": {"path": "m"}, "parallel": {"ep_size": 4}},
                          {"parallel.eplb.num_redundant_experts": 8, "parallel.eplb.algorithm": "global"})
    assert (config.parallel.eplb.num_redundant_experts, config.parallel.eplb.algorithm) == (8, "global")
    assert config.parallel.eplb.enabled and config.parallel.eplb.window_steps == 32


@pytest.mark.parametrize("parallel,match", [
    ({"ep_size": 1, "eplb": {"num_redundant_experts": 2}}, "parallel.eplb.num_redundant_experts needs parallel.ep_size"),
    ({"ep_size": 4, "eplb": {"num_redundant_experts": 6}}, "parallel.eplb.num_redundant_experts 6 is not a multiple"),
    ({"ep_size": 2, "eplb": {"window_steps": 0}}, "parallel.eplb.window_steps"),
    ({"ep_size": 2, "eplb": {"algorithm": "greedy"}}, "parallel.eplb.algorithm"),
    ({"ep_size": 2, "eplb": {"slots": 2}}, "unknown key parallel.eplb.slots"),
])
def test_eplb_bad_configs_name_the_key(parallel, match):
    with pytest.raises(ConfigError, match=match):
        build_config({"model": {"path": "m"}, "parallel": parallel})


# ------------------------------------------------------------------ across ranks (spawned, gloo)

def eplb_config(paths: dict, ep_size: int, s: dict):
    import dataclasses

    from test_distributed_engine import engine_config
    config = engine_config(paths, ep_size, s["spec"], s.get("microbatch", True), s.get("attention", "dp"),
                           exchange=s.get("exchange", "fixed"), overlap=s.get("overlap", False),
                           compile=bool(s.get("compile")), cuda_graph=s.get("cuda_graph", False))
    if ep_size == 1:
        return config
    eplb = dataclasses.replace(config.parallel.eplb, num_redundant_experts=s.get("redundant", ep_size),
                               window_steps=4, rebalance_interval_steps=4, algorithm=s.get("algorithm", "auto"),
                               init=s.get("init"))
    return dataclasses.replace(config, parallel=dataclasses.replace(config.parallel, eplb=eplb))


def slots_hold_their_experts(engine, path: str) -> bool:
    """Every local slot of every EP layer holds the checkpoint's weights of the logical expert
    the placement puts there."""
    from moespec.models import load_model
    reference = load_model(path)
    full = [m for m in reference.modules() if type(m).__name__ == "LocalExperts"]
    balancer = engine.lockstep.balancer
    for index, layer in enumerate(balancer.layers):
        row = balancer.tables.placement.phys_to_log[index]
        for j in range(layer.num_local):
            expert = int(row[layer.first + j])
            if not (torch.equal(layer.w13[j], full[index].w13[expert]) and
                    torch.equal(layer.w2[j], full[index].w2[expert])):
                return False
    return True


def eplb_rank_main(rank: int, paths: dict, ep_size: int, scenarios: list[dict]):
    """Per scenario: (outputs on rank 0, rebalances, slots moved between ranks, slots hold their
    experts, per-layer stats, slot ranks of expert replicas before and after)."""
    from test_distributed_engine import run_schedule

    from moespec.distributed import join_ranks
    from moespec.engine import Engine
    ranks = join_ranks(eplb_config(paths, ep_size, scenarios[0]))
    results = []
    try:
        for s in scenarios:
            if s.get("compile"):  # dynamo traces the step (the EP layers as opaque ops), no codegen
                import moespec.static_step as static_step
                static_step.COMPILE_BACKEND = s["compile"]
            engine = Engine(eplb_config(paths, ep_size, s), ranks=ranks)
            if s.get("cuda_graph"):
                engine.warm_up()
            balancer = engine.lockstep.balancer
            before = balancer.tables.placement.phys_to_log.clone()
            if ranks.ctx.leader:
                outputs = run_schedule(engine, s["requests"])[0]
                engine.stop_ranks()
            else:
                engine.serve_forever()
                outputs = None
            results.append((outputs, balancer.rebalances, balancer.moved_slots,
                            slots_hold_their_experts(engine, paths["target"]), balancer.stats(), before,
                            balancer.tables.placement.phys_to_log.clone()))
    finally:
        ranks.close()
    return results


def check_eplb_runs(paths: dict, ep_size: int, scenarios: list[dict]):
    from test_distributed_engine import expected_outputs

    from moespec.parallel.local_launch import run_ranks
    results = run_ranks(eplb_rank_main, ep_size, paths, ep_size, scenarios, timeout_s=300)
    for result in results:
        assert result.error is None, result.error
    for i, s in enumerate(scenarios):
        outputs, rebalances, _, holds, stats, before, after = results[0].value[i]
        assert outputs == expected_outputs(paths, s), s
        assert rebalances >= 2, (s, rebalances)
        assert all(r.value[i][3] for r in results), "a slot holds other weights than its placement says"
        assert sum(r.value[i][2] for r in results) > 0, "no expert weights moved between ranks"
        assert not torch.equal(before, after)
        assert stats["layers"] and sum(sum(layer["counts"]) for layer in stats["layers"]) > 0
        check_load_dump(stats, len(before))
    return results


def check_load_dump(stats: dict, num_layers: int) -> None:
    """GET /expert_load's JSON (`ExpertBalancer.stats`) reads back as a parallel.eplb.init file."""
    import json
    import tempfile

    from moespec.parallel.eplb import read_load_file
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        f.write(json.dumps(stats))
        f.flush()
        counts = read_load_file(f.name, num_layers, 8)
    assert counts.tolist() == [layer["counts"] for layer in stats["layers"]]
    for layer in stats["layers"]:
        assert 0 < layer["balancedness"] <= 1 and layer["imbalance"] >= 0
        assert sum(layer["rows_per_rank"]) == pytest.approx(sum(layer["counts"]))


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from tiny_models import save_tiny_deepseek
    target = tmp_path_factory.mktemp("ds-mtp-eplb")
    save_tiny_deepseek(target, mtp=True)
    return {"target": str(target)}


def test_eplb_ep2_rebalancing_keeps_greedy_outputs(paths, tmp_path):
    """EP=2, R=2, rebalanced every 4 steps: no speculation and MTP k=2, microbatched and not,
    equal one process token for token; weights really moved (slots hold the experts the
    placement names, and some came from the other rank). The second run starts from a load
    file (parallel.eplb.init, as GET /expert_load writes it): 2 MoE layers + the MTP layer's."""
    import json

    from test_distributed_engine import STAGGERED, TOGETHER
    counts = [[90, 1, 2, 3, 4, 5, 6, 7], [1, 1, 1, 1, 1, 1, 1, 70], [5, 5, 5, 5, 50, 5, 5, 5]]
    init = tmp_path / "load.json"
    init.write_text(json.dumps({"layers": [{"layer": y, "counts": row} for y, row in enumerate(counts)]}))
    results = check_eplb_runs(paths, 2, [
        {"spec": "none", "requests": TOGETHER},
        {"spec": "mtp2", "requests": STAGGERED, "microbatch": False, "init": str(init)},
    ])
    start = results[0].value[1][5]  # the placement the engine started with
    expected = compute_placement(torch.tensor(counts, dtype=torch.float64), 2, 2, num_groups=2)
    assert torch.equal(start, expected.phys_to_log)
    assert all(row.tolist().count(e) >= 2 for row, e in zip(start, (0, 7, 4)))  # each layer's hot expert: replicated


def test_eplb_ep4_rebalancing_keeps_greedy_outputs(paths):
    """EP=4, R=4 (3 slots per rank for 8 experts): MTP k=1 microbatched, rebalanced every 4 steps."""
    from test_distributed_engine import STAGGERED
    check_eplb_runs(paths, 4, [{"spec": "mtp1", "requests": STAGGERED}])


@pytest.mark.slow
def test_eplb_more_combinations_keep_greedy_outputs(paths):
    """The rest of the grid: EP=4 without speculation, MTP k=2 microbatched and not, the uneven
    exchange, replicated attention, R=8, global placement."""
    from test_distributed_engine import STAGGERED, TOGETHER
    check_eplb_runs(paths, 4, [
        {"spec": "none", "requests": TOGETHER, "microbatch": False},
        {"spec": "mtp2", "requests": STAGGERED},
        {"spec": "mtp2", "requests": TOGETHER, "microbatch": False, "redundant": 8, "algorithm": "global"},
        {"spec": "mtp1", "requests": STAGGERED, "exchange": "uneven"},
        {"spec": "mtp1", "requests": TOGETHER, "attention": "replicated"},
    ])
    check_eplb_runs(paths, 2, [
        {"spec": "mtp1", "requests": STAGGERED},
        {"spec": "none", "requests": STAGGERED, "attention": "replicated", "microbatch": False},
    ])


# ------------------------------------------------------------------ recorder and tables (one process)

def test_recorder_counts_over_a_window_and_routes_by_position_without_host_reads():
    from moespec.parallel.eplb import ExpertLoad, ReplicaTables
    from moespec.parallel.placement import Placement
    load = ExpertLoad(num_layers=2, num_experts=4, window_steps=2, device=torch.device("cpu"))
    # layer 0: expert 0 has three copies (slots 0, 4, 5), the others one; 6 slots over 2 ranks
    placement = Placement(torch.tensor([[0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 1, 2]]), 2)
    tables = ReplicaTables(placement, 4, max_copies=3, device=torch.device("cpu"))

    def forward(ids):  # what an EP layer does per forward: fullgraph-compilable, so no host read
        load.record(0, ids)
        return tables.route(0, ids)

    compiled = torch.compile(forward, fullgraph=True, backend="eager")
    ids = torch.tensor([[0, 1], [0, 2], [0, -1], [3, 0]])
    assert compiled(ids).tolist() == [[0, 1], [4, 2], [5, -1], [3, 0]]  # token t -> replica t mod 3 of expert 0
    load.end_step()
    load.record(1, torch.tensor([[1, 2]]))
    load.end_step()
    load.record(0, torch.tensor([[3, 3]]))
    load.end_step()  # the first step leaves the window of 2
    assert load.window().tolist() == [[0, 0, 0, 2], [0, 1, 1, 0]]
    tables.write(Placement(torch.tensor([[0, 1, 2, 3, 3, 3]] * 2), 2))  # in place: same tensors, new values
    assert forward(torch.tensor([[3], [3], [3]])).flatten().tolist() == [3, 4, 5]


def test_moves_take_local_copies_first():
    from moespec.parallel.eplb import plan_moves
    moves = plan_moves(old=[0, 1, 2, 3], new=[0, 3, 2, 1], slots_per_rank=2)
    assert [(m.source_slot, m.source_rank, m.dest_rank) for m in moves] == [(0, 0, 0), (3, 1, 0), (2, 1, 1),
                                                                             (1, 0, 1)]


def test_metrics_show_expert_balance():
    from moespec.server.metrics import ServerMetrics
    metrics = ServerMetrics()
    metrics.observe_experts({"rebalances": 3, "layers": [{"layer": 0, "balancedness": 0.5, "imbalance": 1.0}]})
    text = metrics.render().decode()
    assert 'moespec_expert_balancedness{layer="0"} 0.5' in text
    assert 'moespec_expert_imbalance_ratio{layer="0"} 1.0' in text and "moespec_expert_rebalances 3.0" in text


def test_plan_counts_replica_memory_and_refuses_too_many():
    """DeepSeek-V3 at EP 16: 32 redundant experts are 2 more slots per rank in each of 58 MoE layers
    + the MTP layer (each ~44 MB in FP8 with scales); 256 more do not fit on an H200."""
    from moespec.config import load_config
    from moespec.plan import plan_memory
    H200 = 141 * 10 ** 9
    base = plan_memory(load_config("configs/deepseek-v3.yaml"), H200)
    plan = plan_memory(load_config("configs/deepseek-v3.yaml", {"parallel.eplb.num_redundant_experts": 32}), H200)
    replicas = {c.name: c.bytes for c in plan.components}["redundant experts (parallel.eplb.num_redundant_experts=32)"]
    per_expert = 3 * 7168 * 2048 + 4 * (3 * 56 * 16)  # three e4m3 matrices + float32 128x128 block scales
    assert replicas == 2 * 59 * per_expert
    assert plan.fits and base.kv_bytes - plan.kv_bytes >= replicas - 2 ** 21
    deepep = [{c.name: c for c in p.components}["DeepEP low-latency buffer"] for p in (base, plan)]
    assert "288 expert slots" in deepep[1].note and deepep[1].bytes > deepep[0].bytes  # DeepEP serves every slot
    huge = plan_memory(load_config("configs/deepseek-v3.yaml", {"parallel.eplb.num_redundant_experts": 512}), H200)
    assert not huge.fits and "parallel.eplb.num_redundant_experts=512" in huge.problem


@pytest.mark.slow
def test_eplb_in_compiled_captured_and_overlapped_steps(paths):
    """The recorder and the replica tables inside compiled steps (the EP layers as opaque ops) and
    captured steps (checked replays on CPU: the tables are rewritten in place, so a replay reads
    the new placement), and with overlap scheduling; EP=2, rebalanced every 4 steps."""
    from test_distributed_engine import STAGGERED, TOGETHER
    check_eplb_runs(paths, 2, [
        {"spec": "mtp2", "requests": STAGGERED, "compile": "eager"},
        {"spec": "mtp2", "requests": STAGGERED, "cuda_graph": True, "microbatch": False},
        {"spec": "mtp1", "requests": TOGETHER, "cuda_graph": True},
        {"spec": "mtp2", "requests": STAGGERED, "overlap": True},
    ])


def move_fp8_main(rank: int, _):
    """Two ranks, 3 slots each of FP8 experts with block scales: the placement [0 1 2 | 3 0 1]
    becomes [3 1 0 | 2 3 0]; every slot must then hold its expert's bytes and scales."""
    import types

    from moespec.config import ParallelSection
    from moespec.parallel import destroy, init_parallel
    from moespec.parallel.eplb import move_layer, plan_moves
    ctx = init_parallel(ParallelSection(ep_size=2, timeout_s=30))
    try:
        def expert(e: int) -> tuple[torch.Tensor, ...]:  # distinct bytes per expert
            g = torch.Generator().manual_seed(e)
            return (torch.randn(256, 128, generator=g).to(torch.float8_e4m3fn), torch.rand(2, 1, generator=g),
                    torch.randn(128, 128, generator=g).to(torch.float8_e4m3fn), torch.rand(1, 1, generator=g))
        old, new = [0, 1, 2, 3, 0, 1], [3, 1, 0, 2, 3, 0]
        mine = [expert(e) for e in old[rank * 3:rank * 3 + 3]]
        layer = types.SimpleNamespace(num_local=3, packed=None, **{
            name: torch.stack([m[i] for m in mine]) for i, name in
            enumerate(("w13", "w13_scale_inv", "w2", "w2_scale_inv"))})
        move_layer(layer, plan_moves(old, new, 3), ctx)
        for j, e in enumerate(new[rank * 3:rank * 3 + 3]):
            want = expert(e)
            got = (layer.w13[j], layer.w13_scale_inv[j], layer.w2[j], layer.w2_scale_inv[j])
            if not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want)):
                return False
        return True
    finally:
        destroy(ctx)


def test_fp8_experts_move_with_their_scales():
    from moespec.parallel.local_launch import run_ranks
    results = run_ranks(move_fp8_main, 2, None, timeout_s=60)
    assert [r.error for r in results] == [None, None]
    assert [r.value for r in results] == [True, True]


def test_nodes_come_from_the_launcher(monkeypatch):
    from moespec.distributed import count_nodes
    monkeypatch.delenv("SLURM_NTASKS_PER_NODE", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert (count_nodes(16), count_nodes(8), count_nodes(12)) == (2, 1, 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert count_nodes(4) == 1
