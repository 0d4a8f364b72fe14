"""Model definitions and HF checkpoint loading.

`load_model(dir)` reads config.json, builds the architecture named by `model_type` and loads
its safetensors. Every model has the same contract: `forward(input_ids [T], positions [T], ctx)
-> final-normed hidden [T, M]`, `compute_logits(hidden) -> [T, V]`, `kv_cache_spec()`.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from moespec.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from moespec.models.llama import LlamaConfig, LlamaForCausalLM
from moespec.models.weights import KVSpec, WeightError, WeightLoader, read_hf_config

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["ARCHITECTURES", "DTYPES", "KVSpec", "WeightError", "build_model", "load_config", "load_model",
           "load_tokenizer", "resolve_dtype"]


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; allowed: {sorted(DTYPES)}")
    return DTYPES[dtype]


def load_config(model_dir: str | Path):
    hf = read_hf_config(model_dir)
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise WeightError(f"config.json model_type {model_type!r} is not supported; allowed: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[model_type][0].from_hf(hf)


def build_model(config, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                **kwargs) -> nn.Module:
    model_cls = ARCHITECTURES[config.model_type][1]
    model = model_cls(config, **kwargs).to(device=device, dtype=dtype)
    for module in model.modules():
        if getattr(module, "keep_fp32", False):  # router weights stay float32, as in the reference
            module.float()
    return model


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               show_progress: bool = True, **kwargs) -> nn.Module:
    dtype = resolve_dtype(dtype)
    config = load_config(model_dir)
    loader = WeightLoader(model_dir, dtype, show_progress=show_progress)
    fit_config = getattr(ARCHITECTURES[config.model_type][1], "fit_config", None)
    if fit_config is not None:
        config = fit_config(config, list(loader.files))
    model = build_model(config, dtype, device, **kwargs)
    model.load_weights(loader)
    return model.eval().requires_grad_(False)


def load_tokenizer(model_dir: str | Path):
    """The model directory's HF tokenizer, or None when it ships none (token-id prompts only)."""
    path = Path(model_dir)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
