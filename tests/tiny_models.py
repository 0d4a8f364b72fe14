"""Random tiny checkpoints saved with transformers' save_pretrained, built once per session."""
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, LlamaConfig, LlamaForCausalLM

from reference import randomize_routing


def save_tiny_deepseek(path, mtp: bool = False) -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    config = DeepseekV3Config(vocab_size=120, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                              num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                              kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
                              v_head_dim=16, max_position_embeddings=128, eos_token_id=None, bos_token_id=None,
                              num_nextn_predict_layers=0)
    model = DeepseekV3ForCausalLM(config).eval()
    randomize_routing(model)
    model.save_pretrained(path)
    return model


def save_tiny_llama(path) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=None, bos_token_id=None)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model
