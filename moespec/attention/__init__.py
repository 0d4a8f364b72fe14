"""Attention backends: `torch` (reference, any device) and `flashinfer` (CUDA)."""
from moespec.attention.base import AttentionBackend, AttentionMetadata, ForwardContext, LayerKV
from moespec.attention.torch_backend import DenseCausalAttention, TorchPagedAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "ForwardContext", "LayerKV", "TorchPagedAttention",
           "DenseCausalAttention", "create_backend"]


def create_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchPagedAttention()
    if name == "flashinfer":
        from moespec.attention.flashinfer_backend import FlashInferAttention
        return FlashInferAttention()
    raise ValueError(f"attention backend {name!r} is not known; allowed: 'torch', 'flashinfer'")
