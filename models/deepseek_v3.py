"""DeepSeek-V3 architecture: MLA attention (absorbed, latent KV cache), group-limited sigmoid MoE
with shared experts, `first_k_dense_replace` dense layers, and the MTP module.

Shapes legend: T tokens, H heads, C kv_lora_rank, R rope dim, Dn nope head dim, Dv value head dim,
E experts, A activated experts per token, M hidden, I intermediate, V vocab.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from moespec.attention.base import ForwardContext
from moespec.models.layers import GatedMLP, Linear, RMSNorm, RopeConfig, RotaryEmbedding, yarn_mscale
from moespec.models.moe import LocalExperts, MoEExperts
from moespec.models.two_batch import Stages, run_halves
from moespec.models.weights import KVSpec, WeightError, WeightLoader, hf_eos_ids, hf_get

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeepseekV3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    first_k_dense_replace: int = 0
    num_nextn_predict_layers: int = 0
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    model_type: str = "deepseek_v3"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: dict) -> "DeepseekV3Config":
        scoring = hf.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise WeightError(f"config.json: scoring_func {scoring!r} is not supported; allowed: 'sigmoid'")
        required = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "n_routed_experts", "num_experts_per_tok")
        values = {k: hf_get(hf, k) for k in required}
        return cls(
            # absent keys take transformers' DeepseekV3Config defaults, so both read a config alike
            **values, q_lora_rank=hf.get("q_lora_rank", 1536), n_shared_experts=hf.get("n_shared_experts", 1) or 0,
            n_group=hf.get("n_group", 8) or 1, topk_group=hf.get("topk_group", 4) or 1,
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            first_k_dense_replace=hf.get("first_k_dense_replace", 3) or 0,
            num_nextn_predict_layers=hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0)) or 0,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope=RopeConfig.from_hf(hf),
            rope_interleave=bool(hf.get("rope_interleave", True)), attention_bias=bool(hf.get("attention_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"), eos_token_ids=hf_eos_ids(hf),
        )


class MLAttention(nn.Module):
    """Multi-head latent attention in absorbed form: the cache holds only the normalized latent
    c_kv [C] and the rotated shared key k_pe [R] per token; W_UK is folded into the query and W_UV
    applied after attention, so attention is MQA with key dim C+R and value dim C."""

    def __init__(self, config: DeepseekV3Config, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        c = config
        self.num_heads, self.nope_dim, self.rope_dim, self.v_dim = (c.num_attention_heads, c.qk_nope_head_dim,
                                                                    c.qk_rope_head_dim, c.v_head_dim)
        self.kv_lora_rank = c.kv_lora_rank
        M, H = c.hidden_size, c.num_attention_heads
        if c.q_lora_rank is None:
            self.q_proj = Linear(M, H * c.qk_head_dim)
        else:
            self.q_a_proj = Linear(M, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = Linear(c.q_lora_rank, H * c.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(M, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = Linear(c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim))
        self.o_proj = Linear(H * c.v_head_dim, M, bias=c.attention_bias)
        self.scale = c.qk_head_dim ** -0.5
        if c.rope.type != "default" and c.rope.mscale_all_dim:
            self.scale *= yarn_mscale(c.rope.factor, c.rope.mscale_all_dim) ** 2

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext) -> torch.Tensor:
        T, H, C = x.shape[0], self.num_heads, self.kv_lora_rank
        q = self.project_q(x).view(T, H, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)  # [T, H, Dn], [T, H, R]
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([C, self.rope_dim], dim=-1)  # [T, C], [T, R]
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe = rope.apply(q_pe, *cos_sin)
        k_pe = rope.apply(k_pe[:, None, :], *cos_sin)  # [T, 1, R]

        w_kv = self.kv_b_proj.weight.view(H, self.nope_dim + self.v_dim, C)
        w_uk, w_uv = w_kv[:, : self.nope_dim], w_kv[:, self.nope_dim:]  # [H, Dn, C], [H, Dv, C]
        q_latent = torch.einsum("thd,hdc->thc", q_nope, w_uk)  # [T, H, C]
        query = torch.cat([q_latent, q_pe], dim=-1)  # [T, H, C+R]
        key = torch.cat([c_kv[:, None, :], k_pe], dim=-1)  # [T, 1, C+R]
        out_latent = ctx.attend(self.layer_id, query, key, None, self.scale, C)  # [T, H, C]
        out = torch.einsum("thc,hvc->thv", out_latent, w_uv)  # [T, H, Dv]
        return self.o_proj(out.reshape(T, H * self.v_dim))


class TopkRouter(nn.Module):
    """Sigmoid scores; choice = score + e_score_correction_bias, limited to the best `topk_group`
    groups (group score = sum of its top-2); weights = chosen scores, normalized, scaled."""

    keep_fp32 = True

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.top_k, self.n_group, self.topk_group = config.num_experts_per_tok, config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            T, E = choice.shape
            grouped = choice.view(T, self.n_group, E // self.n_group)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, n_group]
            best_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
            choice = choice.masked_fill(~group_mask[:, :, None].expand_as(grouped).reshape(T, E), float("-inf"))
        topk_ids = choice.topk(self.top_k, dim=-1, sorted=False)[1]  # [T, A]
        weights = scores.gather(1, topk_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_ids, weights * self.scaling


class DeepseekMoE(nn.Module):
    def __init__(self, config: DeepseekV3Config, experts: MoEExperts) -> None:
        super().__init__()
        self.gate = TopkRouter(config)
        self.experts = experts
        self.shared_experts = (GatedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)
                               if config.n_shared_experts else None)
        if hasattr(experts, "bind_shared"):  # expert parallel: a compiled step runs both in one opaque op
            experts.bind_shared(self.shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.gate(x)
        forward_with_shared = getattr(self.experts, "forward_with_shared", None)
        if forward_with_shared is not None:  # expert parallel: shared experts run while all-to-alls fly
            return forward_with_shared(x, topk_ids, topk_weights.to(x.dtype), self.shared_experts)
        out = self.experts(x, topk_ids, topk_weights.to(x.dtype))
        return out + self.shared_experts(x) if self.shared_experts is not None else out

    def stages(self, x: torch.Tensor, first: bool) -> Stages:
        """forward as a generator that yields while the expert-parallel exchange is in flight
        (two-batch overlap); local experts have nothing in flight."""
        stages = getattr(self.experts, "stages", None)
        if stages is None:
            return self(x)
        topk_ids, topk_weights = self.gate(x)
        return (yield from stages(x, topk_ids, topk_weights.to(x.dtype), self.shared_experts, first))


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, config: DeepseekV3Config, layer_id: int, experts_factory) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, layer_id)
        if layer_id >= config.first_k_dense_replace:
            self.mlp = DeepseekMoE(config, experts_factory(config))
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: tuple[torch.Tensor, torch.Tensor],
                ctx: ForwardContext) -> torch.Tensor:
        x = self.attention_block(x, rope, cos_sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))

    def attention_block(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: tuple[torch.Tensor, torch.Tensor],
                        ctx: ForwardContext) -> torch.Tensor:
        return x + self.self_attn(self.input_layernorm(x), rope, cos_sin, ctx)

    def stages(self, x: torch.Tensor, rope: RotaryEmbedding, cos_sin: tuple[torch.Tensor, torch.Tensor],
               ctx: ForwardContext, first: bool) -> Stages:
        """forward over one microbatch, yielding while its MoE tokens are in flight."""
        x = self.attention_block(x, rope, cos_sin, ctx)
        mlp_in = self.post_attention_layernorm(x)
        if isinstance(self.mlp, DeepseekMoE):
            return x + (yield from self.mlp.stages(mlp_in, first))
        return x + self.mlp(mlp_in)


class SharedHead(nn.Module):
    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class MTPLayer(DeepseekDecoderLayer):
    """DeepSeek-V3 multi-token prediction module, stored as `model.layers.{num_hidden_layers + i}`.

    Input at position i: the embedding of token i+1 and the target's final hidden state at i;
    eh_proj(concat(enorm(embedding), hnorm(hidden))) -> one decoder block -> shared_head.norm.
    Embeddings and lm_head are shared with the target.
    """

    def __init__(self, config: DeepseekV3Config, layer_id: int, experts_factory) -> None:
        super().__init__(config, layer_id, experts_factory)
        M = config.hidden_size
        self.enorm = RMSNorm(M, config.rms_norm_eps)
        self.hnorm = RMSNorm(M, config.rms_norm_eps)
        self.eh_proj = Linear(2 * M, M)
        self.shared_head = SharedHead(config)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: RotaryEmbedding,
                cos_sin: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext) -> torch.Tensor:
        x = super().forward(self.mix(embeds, hidden), rope, cos_sin, ctx)
        return self.shared_head.norm(x)

    def mix(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))  # [T, M]

    def stages(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: RotaryEmbedding,
               cos_sin: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext, first: bool) -> Stages:
        x = yield from super().stages(self.mix(embeds, hidden), rope, cos_sin, ctx, first)
        return self.shared_head.norm(x)


class DeepseekV3Model(nn.Module):
    def __init__(self, config: DeepseekV3Config, experts_factory) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(config, i, experts_factory)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.qk_rope_head_dim, config.rope, config.max_position_embeddings,
                                          interleave=config.rope_interleave)


EXPERT_PARAM = re.compile(r"\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")
DEQUANTIZED = ("kv_b_proj",)  # absorbed into attention as [H, D, C] slices: kept in the model dtype
MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


class DeepseekV3ForCausalLM(nn.Module):
    """forward(input_ids [T], positions [T], ctx) -> final-normed hidden [T, M].

    `forward_mtp(i, next_ids [T], hidden [T, M], positions [T], ctx)` runs MTP module i and returns
    its hidden [T, M]; `compute_mtp_logits(i, hidden)` projects it with the shared head. The
    `experts_factory(config) -> MoEExperts` decides where routed experts live (local or EP)."""

    def __init__(self, config: DeepseekV3Config, experts_factory=None) -> None:
        super().__init__()
        self.config = config
        factory = experts_factory or LocalExperts.for_config
        self.model = DeepseekV3Model(config, factory)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        L = config.num_hidden_layers
        self.mtp = nn.ModuleList(MTPLayer(config, L + i, factory) for i in range(config.num_nextn_predict_layers))
        self.mtp_embeds: list[nn.Embedding] = [self.model.embed_tokens] * len(self.mtp)
        self.mtp_heads: list[nn.Module] = [self.lm_head] * len(self.mtp)

    @staticmethod
    def fit_config(config: DeepseekV3Config, tensor_names: list[str]) -> DeepseekV3Config:
        """Configs declare MTP layers that some checkpoints do not store: keep only stored ones."""
        L = config.num_hidden_layers
        stored = sum(any(n.startswith(f"model.layers.{L + i}.") for n in tensor_names)
                     for i in range(config.num_nextn_predict_layers))
        if stored < config.num_nextn_predict_layers:
            logger.warning("config declares %d MTP layer(s), checkpoint stores %d: loading %d",
                           config.num_nextn_predict_layers, stored, stored)
            return dataclasses.replace(config, num_nextn_predict_layers=stored)
        return config

    @property
    def num_mtp_layers(self) -> int:
        return len(self.mtp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds  # [T, M]
        rope = self.model.rotary_emb
        cos_sin = rope(positions, x.dtype)
        if ctx.halves is not None:  # two-batch overlap
            return run_halves(ctx, self.stages, x, cos_sin)
        for layer in self.model.layers:
            x = layer(x, rope, cos_sin, ctx)
        return self.model.norm(x)

    def stages(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext,
               first: bool) -> Stages:
        """forward over one microbatch [T', M], yielding while its MoE tokens are in flight, so the
        other microbatch's attention runs meanwhile (models/two_batch.py)."""
        for layer in self.model.layers:
            x = yield from layer.stages(x, self.model.rotary_emb, cos_sin, ctx, first)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [T, V]

    def forward_mtp(self, index: int, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    ctx: ForwardContext) -> torch.Tensor:
        rope = self.model.rotary_emb
        embeds = self.mtp_embeds[index](next_ids)
        cos_sin = rope(positions, hidden.dtype)
        if ctx.halves is not None:  # two-batch overlap
            layer = self.mtp[index]
            return run_halves(ctx, lambda e, h, cs, c, first: layer.stages(e, h, rope, cs, c, first),
                              embeds, hidden, cos_sin)
        return self.mtp[index](embeds, hidden, rope, cos_sin, ctx)

    def compute_mtp_logits(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.mtp_heads[index](hidden)

    def kv_cache_spec(self) -> list[KVSpec]:
        c = self.config
        spec = KVSpec(1, c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank, separate_v=False)
        return [spec] * (c.num_hidden_layers + c.num_nextn_predict_layers)

    # ------------------------------------------------------------------ checkpoint names

    def mtp_index(self, name: str) -> tuple[int, str] | None:
        """(MTP index, rest of name) for a checkpoint tensor at model.layers.{L+i}, else None."""
        match = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if match is None or int(match.group(1)) < self.config.num_hidden_layers:
            return None
        return int(match.group(1)) - self.config.num_hidden_layers, match.group(2)

    def rename(self, name: str) -> str | None:
        """HF/DeepSeek tensor name -> parameter name; MTP layers live at model.layers.{L+i}."""
        name = EXPERT_PARAM.sub(lambda m: (".experts.w2" if m.group(1) == "down_proj" else ".experts.w13")
                                + (m.group(2) or ""), name)
        found = self.mtp_index(name)
        if found is None:
            return name
        index, rest = found
        return f"mtp.{index}.{rest}" if index < len(self.mtp) else None  # extra stored MTP layers unused

    def is_mtp_shared(self, name: str) -> bool:
        found = self.mtp_index(name)
        return found is not None and found[0] < len(self.mtp) and found[1] in MTP_SHARED

    def checkpoint_name(self, param: str) -> str:
        match = re.match(r"mtp\.(\d+)\.(.*)", param)
        if match is None:
            return param
        return f"model.layers.{self.config.num_hidden_layers + int(match.group(1))}.{match.group(2)}"

    def fp8_modules(self) -> list[nn.Module]:
        """The modules whose weights stay FP8 when the checkpoint is FP8 (DeepSeek's released
        layout): every projection of the decoder layers, MTP block included, and the routed and
        shared experts; not the embeddings, lm_head, router, eh_proj or kv_b_proj."""
        layers = list(self.model.layers) + list(self.mtp)
        return [module for layer in layers for name, module in layer.named_modules()
                if name.startswith(("self_attn.", "mlp.")) and not name.endswith(DEQUANTIZED)
                and hasattr(module, "to_fp8")]

    def load_weights(self, loader: WeightLoader) -> None:
        ignore = ("lm_head.weight",) if self.config.tie_word_embeddings else ()
        shared = loader.load_into(self, rename=self.rename, checkpoint_name=self.checkpoint_name,
                                  ignore_missing=ignore, ignore_unexpected=ignore, capture=self.is_mtp_shared)
        for name in shared:
            self.attach_mtp_shared(name, loader)

    def attach_mtp_shared(self, name: str, loader: WeightLoader) -> None:
        """MTP layers store their own copy of embed_tokens / shared_head.head; share the target's
        tensor when equal (as in the released checkpoints; compared a few rows at a time) and keep a
        separate copy otherwise."""
        index, rest = self.mtp_index(name)
        is_embed = rest.startswith("embed")
        main = self.model.embed_tokens if is_embed else self.lm_head
        shape = tuple(loader.entry(name).shape)
        if shape != tuple(main.weight.shape):
            raise WeightError(f"tensor {name!r} has shape {shape}, expected {tuple(main.weight.shape)}")
        if loader.equals(name, main.weight.data):
            return
        device, dtype = main.weight.device, main.weight.dtype
        own = nn.Embedding(*shape, device=device, dtype=dtype) if is_embed else \
            Linear(shape[1], shape[0]).to(device=device, dtype=dtype)
        loader.read_into(name, own.weight.data)
        (self.mtp_embeds if is_embed else self.mtp_heads)[index] = own
