"""MTP heads trained for a frozen target (EAGLE-style drafters), behind the same contract as
DeepSeek-V3's built-in MTP layer so the speculation engine treats both alike.

A head predicts the target's next hidden state from (embedding of token i+1, target hidden at i)
with one decoder layer of the target's architecture; the target's embeddings and lm_head are
shared and frozen. Two layouts:

- `eagle` (EAGLE-1): fc(concat(emb, hidden)) with bias -> decoder layer without input_layernorm
  -> lm_head directly (no final norm).
- `rmsnorm` (DeepSeek MTP layout): eh_proj(concat(enorm(emb), hnorm(hidden))) -> full decoder
  layer -> final norm -> lm_head.

A head may draft over a reduced vocabulary (`draft_vocab_size` N > 0, the ids in its `draft_vocab`
buffer, e.g. the target's most frequent output tokens): its logits are then the lm_head rows of
those N tokens alone, an N/V share of the full projection, and every other token gets a draft
probability of exactly 0 (a logit far below any real one: it underflows in the softmax, yet a row
whose draft tokens are all masked, by a grammar say, still has a distribution). Verification
keeps the target's full distribution, so speculation stays lossless.

A head directory holds `config.json` (`model_type: "mtp_head"`, `head_architecture`,
`base_model_type`, `draft_vocab_size` and the decoder layer's HF config keys) and
`model.safetensors` with the head's weights only (and `draft_vocab`, int64).

Shapes legend: T tokens, M hidden, V vocab, N draft vocab.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from moespec.attention.base import ForwardContext
from moespec.models.deepseek_v3 import DeepseekDecoderLayer, DeepseekV3Config
from moespec.models.layers import Linear, RMSNorm, RotaryEmbedding, unmerge_tensors
from moespec.models.llama import LlamaConfig, LlamaDecoderLayer
from moespec.models.weights import KVSpec, WeightError, WeightLoader, read_hf_config

HEAD_ARCHITECTURES = ("eagle", "rmsnorm")
BASE_CONFIGS = {"llama": LlamaConfig, "deepseek_v3": DeepseekV3Config}
# A token outside a head's draft vocabulary: exp(-1e4 - max) is 0 in float32 beside any real logit,
# and stays finite through temperatures, penalties and biases, so a row whose draft tokens are all
# masked still has a distribution (over the tokens the mask allows).
OUTSIDE_DRAFT_VOCAB = -1.0e4
# Keys of the target's config.json that describe its decoder layer; a head keeps only these.
LAYER_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
              "rope_parameters", "attention_bias", "mlp_bias", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "rope_interleave", "moe_intermediate_size", "n_routed_experts",
              "num_experts_per_tok")


@dataclass(frozen=True)
class MTPHeadConfig:
    head_architecture: str
    base_model_type: str
    layer: dict  # HF config keys of the decoder layer (the target's, dense MLP)
    draft_vocab_size: int = 0  # N > 0: the head drafts over N token ids (its draft_vocab); 0: all


    def __post_init__(self) -> None:
        if self.head_architecture not in HEAD_ARCHITECTURES:
            raise ValueError(f"head_architecture {self.head_architecture!r} is not known; "
                             f"allowed: {HEAD_ARCHITECTURES}")
        if self.base_model_type not in BASE_CONFIGS:
            raise ValueError(f"base_model_type {self.base_model_type!r} is not supported; "
                             f"allowed: {sorted(BASE_CONFIGS)}")
        if not 0 <= self.draft_vocab_size <= self.layer.get("vocab_size", self.draft_vocab_size):
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} is not in [0, vocab_size "
                             f"{self.layer.get('vocab_size')}]")

    @classmethod
    def for_target(cls, target_hf: dict, head_architecture: str, draft_vocab_size: int = 0) -> "MTPHeadConfig":
        """A head for the target whose config.json is `target_hf`; DeepSeek heads use a dense MLP."""
        layer = {k: target_hf[k] for k in LAYER_KEYS if target_hf.get(k) is not None}
        return cls(head_architecture, target_hf["model_type"], layer, draft_vocab_size)

    @classmethod
    def from_hf(cls, hf: dict) -> "MTPHeadConfig":
        if hf.get("model_type") != "mtp_head":
            raise WeightError(f"config.json model_type {hf.get('model_type')!r} is not 'mtp_head'")
        layer = {k: v for k, v in hf.items() if k not in ("model_type", "head_architecture", "base_model_type",
                                                           "num_hidden_layers", "architectures", "draft_vocab_size")}
        return cls(hf["head_architecture"], hf["base_model_type"], layer, int(hf.get("draft_vocab_size", 0)))

    def to_hf(self) -> dict:
        return {"model_type": "mtp_head", "head_architecture": self.head_architecture,
                "base_model_type": self.base_model_type, "num_hidden_layers": 1,
                "draft_vocab_size": self.draft_vocab_size, **self.layer}

    def base_config(self) -> LlamaConfig | DeepseekV3Config:
        hf = {**self.layer, "model_type": self.base_model_type, "num_hidden_layers": 1}
        if self.base_model_type == "deepseek_v3":
            hf.update(first_k_dense_replace=1, n_shared_experts=0, num_nextn_predict_layers=0)
        return BASE_CONFIGS[self.base_model_type].from_hf(hf)


class MTPHead(nn.Module):
    """forward(embeds [T, M], hidden [T, M], positions [T], ctx) -> head hidden [T, M] (lm_head input)."""

    def __init__(self, config: MTPHeadConfig) -> None:
        super().__init__()
        self.config = config
        base = self.base = config.base_config()
        M = base.hidden_size
        if config.head_architecture == "rmsnorm":
            self.enorm = RMSNorm(M, base.rms_norm_eps)
            self.hnorm = RMSNorm(M, base.rms_norm_eps)
            self.eh_proj = Linear(2 * M, M)
            self.norm = RMSNorm(M, base.rms_norm_eps)
        else:
            self.fc = Linear(2 * M, M, bias=True)
        self.layers = nn.ModuleList([build_decoder_layer(base)])
        if config.head_architecture == "eagle":
            self.layers[0].input_layernorm = nn.Identity()  # EAGLE-1 drops the first layer's input norm
        self.rotary_emb = build_rotary(base)
        if config.draft_vocab_size:
            self.register_buffer("draft_vocab", torch.arange(config.draft_vocab_size))  # [N] token ids
        else:
            self.draft_vocab = None

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        if self.config.head_architecture == "rmsnorm":
            x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))  # [T, M]
        else:
            x = self.fc(torch.cat([embeds, hidden], dim=-1))  # [T, M]
        cos_sin = self.rotary_emb(positions, x.dtype)
        x = self.layers[0](x, self.rotary_emb, cos_sin, ctx)
        return self.norm(x) if self.config.head_architecture == "rmsnorm" else x

    def kv_cache_spec(self) -> list[KVSpec]:
        c = self.base
        if isinstance(c, DeepseekV3Config):
            return [KVSpec(1, c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank, separate_v=False)]
        return [KVSpec(c.num_key_value_heads, c.head_dim, c.head_dim)]


def build_decoder_layer(base: LlamaConfig | DeepseekV3Config) -> nn.Module:
    if isinstance(base, DeepseekV3Config):
        return DeepseekDecoderLayer(base, 0, experts_factory=None)  # layer 0 < first_k_dense_replace: dense
    return LlamaDecoderLayer(base, 0)


def build_rotary(base: LlamaConfig | DeepseekV3Config) -> RotaryEmbedding:
    if isinstance(base, DeepseekV3Config):
        return RotaryEmbedding(base.qk_rope_head_dim, base.rope, base.max_position_embeddings,
                               interleave=base.rope_interleave)
    return RotaryEmbedding(base.head_dim, base.rope, base.max_position_embeddings)


class MTPHeadModel(nn.Module):
    """A frozen target plus a trained head, with DeepSeek's MTP contract: `forward_mtp(0, next_ids
    [T], hidden [T, M], positions [T], ctx) -> [T, M]`, `compute_mtp_logits(0, hidden) -> [T, V]`
    through the target's shared lm_head, and `kv_cache_spec()` for the head's own layer."""

    def __init__(self, target: nn.Module, head: MTPHead) -> None:
        super().__init__()
        check_head_fits(target, head)
        self.target = target
        self.head = head
        self.draft_lm_head = draft_lm_head(target, head.draft_vocab)

    @property
    def num_mtp_layers(self) -> int:
        return 1

    def forward_mtp(self, index: int, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    ctx: ForwardContext) -> torch.Tensor:
        check_index(index)
        return self.head(self.target.embed(next_ids), hidden, positions, ctx)

    def compute_mtp_logits(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, M] -> logits [T, V]: the target's lm_head, or over a reduced vocabulary the
        draft tokens' rows alone, every other token OUTSIDE_DRAFT_VOCAB (draft probability 0)."""
        check_index(index)
        if self.draft_lm_head is None:
            return self.target.compute_logits(hidden)
        draft = self.draft_lm_head(hidden)  # [T, N]
        logits = draft.new_full((hidden.shape[0], self.target.config.vocab_size), OUTSIDE_DRAFT_VOCAB)  # [T, V]
        return logits.index_copy_(1, self.head.draft_vocab, draft)

    def kv_cache_spec(self) -> list[KVSpec]:
        return self.head.kv_cache_spec()


def draft_lm_head(target: nn.Module, draft_vocab: torch.Tensor | None) -> Linear | None:
    """The rows of the target's lm_head for the draft vocabulary [N] as their own projection
    [N, M] (a copy: N/V of the lm_head's bytes), or None for the full vocabulary."""
    if draft_vocab is None:
        return None
    weight = target.lm_head.weight.detach()
    projection = Linear(weight.shape[1], draft_vocab.numel()).to(device=weight.device, dtype=weight.dtype)
    projection.weight = nn.Parameter(weight.index_select(0, draft_vocab.to(weight.device)), requires_grad=False)
    return projection


def check_index(index: int) -> None:
    if index != 0:
        raise IndexError(f"an MTP head has one layer; got MTP index {index}, allowed: 0")


def check_head_fits(target: nn.Module, head: MTPHead) -> None:
    c, h = target.config, head.base
    if (c.model_type, c.hidden_size, c.vocab_size) != (h.model_type, h.hidden_size, h.vocab_size):
        raise WeightError(f"head is for a {h.model_type} target with hidden {h.hidden_size}, vocab {h.vocab_size}; "
                          f"got a {c.model_type} target with hidden {c.hidden_size}, vocab {c.vocab_size}")


def load_mtp_head(target: nn.Module, head_dir: str | Path, dtype: torch.dtype = torch.float32) -> MTPHeadModel:
    config = MTPHeadConfig.from_hf(read_hf_config(head_dir))
    head = MTPHead(config).to(dtype)
    WeightLoader(head_dir, show_progress=False).load_into(head)
    device = next(target.parameters()).device
    return MTPHeadModel(target, head.to(device).eval().requires_grad_(False))


def save_mtp_head(head: MTPHead, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                  extra_config: dict | None = None) -> None:
    """Head weights only (no embeddings or lm_head) plus config.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = unmerge_tensors(head, head.state_dict())  # q/k/v and gate/up under their own names
    tensors = {n: (t.detach().to(dtype) if t.is_floating_point() else t.detach()).contiguous().clone()
               for n, t in state.items()}  # the draft vocabulary's ids stay integers
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {**head.config.to_hf(), "torch_dtype": str(dtype).removeprefix("torch."), **(extra_config or {})}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


__all__ = ["HEAD_ARCHITECTURES", "MTPHead", "MTPHeadConfig", "MTPHeadModel", "load_mtp_head", "save_mtp_head"]
