"""Attention backends: `torch` (reference, any device) and `flashinfer` (CUDA)."""
import torch

from moespec.attention.base import AttentionBackend, AttentionMetadata, ForwardContext, LayerKV, plan_forward
from moespec.attention.torch_backend import DenseCausalAttention, TorchPagedAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "ForwardContext", "LayerKV", "TorchPagedAttention",
           "DenseCausalAttention", "create_backend", "plan_forward"]


def create_backend(name: str, device: str | torch.device = "cpu") -> AttentionBackend:
    """`device`: the model's (FlashInfer allocates its workspace there)."""
    if name == "torch":
        return TorchPagedAttention()
    if name == "flashinfer":
        from moespec.attention.flashinfer_backend import FlashInferAttention
        return FlashInferAttention(device)
    raise ValueError(f"attention backend {name!r} is not known; allowed: 'torch', 'flashinfer'")
