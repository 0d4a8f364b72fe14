"""Llama-3 style decoder (GQA, llama3 rope scaling, optional tied embeddings).

Shapes legend: T tokens, H query heads, Hk kv heads, D head dim, M hidden, V vocab.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from moespec.attention.base import ForwardContext
from moespec.models.layers import GatedMLP, Linear, MergedLinear, RMSNorm, RopeConfig, RotaryEmbedding
from moespec.models.weights import KVSpec, WeightLoader, hf_get, hf_eos_ids


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "llama"

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        heads = hf_get(hf, "num_attention_heads")
        return cls(
            vocab_size=hf_get(hf, "vocab_size"), hidden_size=hf_get(hf, "hidden_size"),
            intermediate_size=hf_get(hf, "intermediate_size"), num_hidden_layers=hf_get(hf, "num_hidden_layers"),
            num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf_get(hf, "hidden_size") // heads,
            max_position_embeddings=hf.get("max_position_embeddings", 2048), rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
            rope=RopeConfig.from_hf(hf), bos_token_id=hf.get("bos_token_id"), eos_token_ids=hf_eos_ids(hf),
        )


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        M, bias, H, Hk, D = config.hidden_size, config.attention_bias, self.num_heads, self.num_kv_heads, self.head_dim
        self.qkv_proj = MergedLinear(M, {"q_proj": H * D, "k_proj": Hk * D, "v_proj": Hk * D}, bias=bias)
        self.o_proj = Linear(H * D, M, bias=bias)
        self.scale = D ** -0.5

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext) -> torch.Tensor:
        T, H, Hk = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(T, H + 2 * Hk, self.head_dim)  # [T, H+2Hk, D]
        qk = rope.apply(qkv[:, : H + Hk], *cos_sin)  # q and k rotated in one call
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hk:]  # [T, H, D], [T, Hk, D], [T, Hk, D]
        out = ctx.attend(self.layer_id, q, k, v, self.scale, self.head_dim)  # [T, H, D]
        return self.o_proj(out.reshape(T, -1))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, cos_sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope, config.max_position_embeddings)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], ctx) -> final-normed hidden [T, M]; logits via compute_logits."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds  # [T, M]
        rope = self.model.rotary_emb
        cos_sin = rope(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, rope, cos_sin, ctx)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [T, V]

    def kv_cache_spec(self) -> list[KVSpec]:
        c = self.config
        return [KVSpec(c.num_key_value_heads, c.head_dim, c.head_dim)] * c.num_hidden_layers

    def load_weights(self, loader: WeightLoader) -> None:
        ignore = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        loader.load_into(self, ignore_missing=ignore, ignore_unexpected=ignore + ("*rotary_emb.inv_freq",))
