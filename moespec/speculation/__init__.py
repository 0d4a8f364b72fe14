"""Speculative decoding modes behind one interface: none, mtp, draft."""
from __future__ import annotations

from moespec.config import EngineConfig, tree_shapes
from moespec.speculation.base import DraftRows, Proposal, Speculator
from moespec.speculation.verify import VerifyResult, select_rows, verify_greedy, verify_lossless, verify_relaxed

__all__ = ["DraftRows", "Proposal", "Speculator", "VerifyResult", "create_speculator", "select_rows",
           "verify_greedy", "verify_lossless", "verify_relaxed"]


def create_speculator(config: EngineConfig, target, target_runner) -> Speculator:
    speculator = create_mode(config, target, target_runner)
    speculator.trees = tuple(tree_shapes(config.speculation))
    return speculator


def create_mode(config: EngineConfig, target, target_runner) -> Speculator:
    spec, cache = config.speculation, config.cache
    if spec.mode == "none":
        return Speculator()
    if spec.mode == "mtp":
        return create_mtp(config, target, target_runner)
    from moespec.models import load_model
    from moespec.speculation.draft import DraftModelSpeculator

    draft = load_model(config.draft.model, config.draft.dtype or config.model.dtype, config.model.device)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft.model vocab_size {draft.config.vocab_size} differs from the target's "
                         f"{target.config.vocab_size}; draft and target must share a tokenizer")
    return DraftModelSpeculator(draft, spec.num_speculative_tokens, cache.num_kv_pages, cache.page_size,
                                config.model.attention_backend, config.model.device, target_runner.static_spec,
                                config.model.pack_linears)


def create_mtp(config: EngineConfig, target, target_runner) -> Speculator:
    from moespec.kv_cache import KVCache
    from moespec.speculation.mtp import MTPSpeculator

    spec, cache = config.speculation, config.cache
    dtype = next(target.parameters()).dtype
    if spec.mtp_head:
        from moespec.model_runner import set_single_row_padding
        from moespec.models.layers import pack_linears, reserve_rope_positions
        from moespec.models.mtp_head import load_mtp_head

        mtp = load_mtp_head(target, spec.mtp_head, dtype)
        reserve_rope_positions(mtp, cache.num_kv_pages * cache.page_size)
        set_single_row_padding(mtp.head, True)  # as for a draft model: target forwards evict its weights
        if config.model.pack_linears:
            pack_linears(mtp.head)
        scratch = 1 if target_runner.static_spec else 0  # static steps' scratch page
        caches = KVCache(mtp.kv_cache_spec(), cache.num_kv_pages + scratch, cache.page_size, dtype,
                         config.model.device).layers
    else:
        if getattr(target, "num_mtp_layers", 0) < 1:
            raise ValueError(f"speculation.mode 'mtp': model {config.model.path!r} has no MTP layer; "
                             "set speculation.mtp_head to a head trained with `moespec train-mtp-head`")
        mtp = target
        caches = target_runner.cache.layers  # the MTP layer's cache is layer num_hidden_layers of the target's
    return MTPSpeculator(mtp, caches, spec.num_speculative_tokens, config.scheduler.max_num_seqs, cache.page_size,
                         target.config.hidden_size, dtype, config.model.device, config.model.attention_backend,
                         target_runner.static_spec, cache.num_kv_pages, spec.mtp_hold_tokens,
                         flush_prompts=cache.prefix_caching)
