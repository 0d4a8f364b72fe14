"""Random tiny checkpoints saved with transformers' save_pretrained, built once per session."""
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from reference import randomize_routing


def save_tiny_deepseek(path, mtp: bool = False, vocab_size: int = 120, layers: int = 3, hidden: int = 64,
                       max_positions: int = 128) -> DeepseekV3ForCausalLM:
    """A random tiny DeepSeek-V3; with `mtp`, plus a random MTP layer in the released naming."""
    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                              num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                              kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
                              v_head_dim=16, max_position_embeddings=max_positions, eos_token_id=None,
                              bos_token_id=None,
                              num_nextn_predict_layers=0)
    model = DeepseekV3ForCausalLM(config).eval()
    randomize_routing(model)
    model.save_pretrained(path)
    if mtp:
        add_random_mtp_layer(path, config, model)
    return model


def add_random_mtp_layer(path, config, model) -> None:
    """Append model.layers.{L}.* (enorm, hnorm, eh_proj, one MoE block, shared_head) to the checkpoint."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    L, M = config.num_hidden_layers, config.hidden_size
    gen = torch.Generator().manual_seed(1)
    block = DeepseekV3DecoderLayer(config, layer_idx=L)
    tensors = load_file(str(Path(path) / "model.safetensors"))
    for name, param in block.state_dict().items():
        value = torch.ones(param.shape) if "norm" in name else torch.randn(param.shape, generator=gen) * 0.05
        if name.endswith("experts.gate_up_proj"):
            for e in range(value.shape[0]):
                gate, up = value[e].chunk(2)
                tensors[f"model.layers.{L}.mlp.experts.{e}.gate_proj.weight"] = gate.contiguous()
                tensors[f"model.layers.{L}.mlp.experts.{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith("experts.down_proj"):
            for e in range(value.shape[0]):
                tensors[f"model.layers.{L}.mlp.experts.{e}.down_proj.weight"] = value[e].contiguous()
        else:
            tensors[f"model.layers.{L}.{name}"] = value
    for name in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"model.layers.{L}.{name}.weight"] = torch.ones(M)
    tensors[f"model.layers.{L}.eh_proj.weight"] = torch.randn(M, 2 * M, generator=gen) * 0.05
    tensors[f"model.layers.{L}.embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    tensors[f"model.layers.{L}.shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    save_file(tensors, str(Path(path) / "model.safetensors"))
    hf = json.loads((Path(path) / "config.json").read_text())
    hf["num_nextn_predict_layers"] = 1
    (Path(path) / "config.json").write_text(json.dumps(hf))


def save_tiny_llama(path, seed: int = 0, layers: int = 3, hidden: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=120, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=None, bos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


def save_random_mtp_head(target: str, path, arch: str = "rmsnorm", draft_vocab: list[int] | None = None) -> str:
    """A random external MTP head for the target checkpoint `target` (norms at one, weights small),
    drafting over `draft_vocab` (token ids) or the whole vocabulary, saved at `path`; returns the
    path as a string."""
    import json
    from pathlib import Path

    from moespec.models.mtp_head import MTPHead, MTPHeadConfig, save_mtp_head

    torch.manual_seed(3)
    target_hf = json.loads((Path(target) / "config.json").read_text())
    head = MTPHead(MTPHeadConfig.for_target(target_hf, arch, len(draft_vocab or ())))
    with torch.no_grad():
        for name, param in head.named_parameters():
            param.copy_(torch.ones_like(param) if "norm" in name else torch.randn_like(param) * 0.1)
        if draft_vocab:
            head.draft_vocab.copy_(torch.tensor(draft_vocab))
    save_mtp_head(head, path, dtype=torch.float32)
    return str(path)
