"""The engine across ranks: the leader schedules and samples, every rank runs each MoE-bearing
forward (target and MTP layer) in lockstep; output equals one process, token for token."""
import pytest
import torch

from moespec.config import build_config
from moespec.parallel.local_launch import run_ranks
from tiny_models import save_tiny_deepseek

PROMPTS = [[3, 40, 7, 9, 1], [9] * 21, [5, 1, 77, 100, 2, 64, 8, 12, 90, 33, 11]]
SPEC = {"mode": "mtp", "num_speculative_tokens": 2, "adaptive": False}


def engine_config(path: str, ep_size: int, microbatch: bool = True):
    return build_config({"model": {"path": path}, "cache": {"page_size": 4, "num_kv_pages": 128},
                         "speculation": SPEC,
                         "parallel": {"ep_size": ep_size, "microbatch": microbatch, "timeout_s": 30}})


def generate(engine) -> list[list[int]]:
    from moespec.sampling import SamplingParams
    seqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            for p, n in zip(PROMPTS, (16, 9, 13))]
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs], engine.spec_stats.steps


def lead_or_follow(config):
    """The leader's Ranks; on the other ranks None, once they have followed the leader to its stop."""
    from moespec.distributed import follow, join_ranks
    ranks = join_ranks(config)
    if ranks.ctx.leader:
        return ranks
    try:
        follow(config, ranks.ctx, ranks.runtime)
    finally:
        ranks.close()
    return None


def rank_main(rank: int, path: str, ep_size: int, microbatch: bool):
    from moespec.engine import Engine
    config = engine_config(path, ep_size, microbatch)
    ranks = lead_or_follow(config)
    if ranks is None:
        return None
    engine = Engine(config, ranks=ranks)
    try:
        return generate(engine)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds-mtp-ep")
    save_tiny_deepseek(path, mtp=True)
    return str(path)


@pytest.mark.parametrize("ep_size,microbatch", [(2, True), (2, False), (4, True)])
def test_ep_greedy_with_mtp_matches_one_process(checkpoint, ep_size, microbatch):
    from moespec.engine import Engine
    expected, _ = generate(Engine(engine_config(checkpoint, 1)))
    results = run_ranks(rank_main, ep_size, checkpoint, ep_size, microbatch, timeout_s=120)
    for result in results:
        assert result.error is None, result.error
    outputs, spec_steps = results[0].value
    assert outputs == expected
    assert spec_steps > 0
    assert all(r.value is None for r in results[1:])


def test_engine_refuses_ep_without_ranks(checkpoint):
    from moespec.engine import Engine
    with pytest.raises(ValueError, match="run_as_rank"):
        Engine(engine_config(checkpoint, 2))


def idle_rank_main(rank: int, path: str, idle_s: float):
    """The leader sits idle (as a server between requests) for longer than the collective
    timeout, keeping its followers alive, then serves."""
    import time
    from moespec.engine import Engine
    config = build_config({"model": {"path": path}, "cache": {"page_size": 4, "num_kv_pages": 128},
                           "speculation": SPEC, "parallel": {"ep_size": 2, "timeout_s": 2}})
    ranks = lead_or_follow(config)
    if ranks is None:
        return None
    engine = Engine(config, ranks=ranks)
    try:
        deadline = time.monotonic() + idle_s
        while time.monotonic() < deadline:
            engine.keep_alive()
            time.sleep(0.05)
        return generate(engine)
    finally:
        engine.close()


def test_idle_leader_keeps_its_followers(checkpoint):
    from moespec.engine import Engine
    expected, _ = generate(Engine(engine_config(checkpoint, 1)))
    results = run_ranks(idle_rank_main, 2, checkpoint, 5.0, timeout_s=120)
    for result in results:
        assert result.error is None, result.error
    assert results[0].value[0] == expected
