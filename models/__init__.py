"""Model definitions and HF checkpoint loading.

`load_model(dir)` reads config.json, builds the architecture named by `model_type` and loads
its safetensors; `dir` may also be a GGUF file or hold one (models.gguf). Every model has the
same contract: `forward(input_ids [T], positions [T], ctx) -> final-normed hidden [T, M]`,
`compute_logits(hidden) -> [T, V]`, `kv_cache_spec()`.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from torch import nn

from moespec.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM
from moespec.models.llama import LlamaConfig, LlamaForCausalLM
from moespec.models import gguf
from moespec.models.weights import KVSpec, WeightError, open_weights, read_hf_config

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
logger = logging.getLogger(__name__)

__all__ = ["ARCHITECTURES", "DTYPES", "KVSpec", "WeightError", "build_model", "load_config", "load_model",
           "load_tokenizer", "materialize", "resolve_dtype", "resolve_quantization", "build_on_meta"]


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; allowed: {sorted(DTYPES)}")
    return DTYPES[dtype]


def load_config(model_dir: str | Path):
    return config_from_hf(read_hf_config(model_dir))


def config_from_hf(hf: dict):
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        raise WeightError(f"config.json model_type {model_type!r} is not supported; allowed: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[model_type][0].from_hf(hf)


def build_model(config, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                quantization: str = "none", **kwargs) -> nn.Module:
    """The architecture with its parameters in `dtype` on `device` (randomly initialized unless
    `device` is "meta": then shapes and dtypes only, nothing allocated). With quantization "fp8"
    the model's `fp8_modules()` keep e4m3 weights and 128x128 block scales."""
    model_cls = ARCHITECTURES[config.model_type][1]
    with torch.device("meta") if str(device) == "meta" else contextlib.nullcontext():
        model = model_cls(config, **kwargs)
    model = model.to(device=device, dtype=dtype)
    for module in model.modules():
        if getattr(module, "keep_fp32", False):  # router weights stay float32, as in the reference
            module.float()
    if quantization == "fp8":
        quantize_fp8(model)
    return model


def quantize_fp8(model: nn.Module) -> None:
    modules = getattr(model, "fp8_modules", None)
    if modules is None:
        raise ValueError(f"model.quantization 'fp8': FP8-resident weights are implemented for DeepSeek-V3's "
                         f"block-scaled checkpoints, not for {model.config.model_type!r}; use 'none'")
    for module in modules():
        module.to_fp8()


def materialize(model: nn.Module, device: str | torch.device) -> None:
    """Give every parameter and buffer of a meta-built model uninitialized storage on `device`, in
    its dtype: each allocated once, ties between modules and loader attributes kept."""
    new: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                if id(tensor) not in new:
                    empty = torch.empty_like(tensor, device=device)
                    if isinstance(tensor, nn.Parameter):
                        empty = nn.Parameter(empty, requires_grad=False)
                        empty.__dict__.update(tensor.__dict__)  # weight_loader, num_loads
                    new[id(tensor)] = empty
                table[name] = new[id(tensor)]


def resolve_quantization(quantization: str, hf: dict) -> str:
    """"auto": "fp8" for a checkpoint with DeepSeek's 128x128 block-scaled e4m3 weights, else "none"."""
    q = hf.get("quantization_config") or {}
    is_fp8 = q.get("quant_method") == "fp8" and q.get("fmt", "e4m3") == "e4m3" and \
        list(q.get("weight_block_size") or [128, 128]) == [128, 128]
    if quantization == "auto":
        return "fp8" if is_fp8 else "none"
    if quantization == "fp8" and not is_fp8:
        raise ValueError(f"model.quantization 'fp8' needs a checkpoint with block-scaled e4m3 weights "
                         f"(config.json quantization_config {q or None}); use 'none' or 'auto'")
    return quantization


def build_on_meta(config, dtype: torch.dtype, quantization: str, hf: dict, **kwargs) -> tuple[nn.Module, str]:
    """The model on the meta device and the quantization it got: "auto" falls back to "none" (with
    a warning) when the architecture cannot keep these weights FP8."""
    resolved = resolve_quantization(quantization, hf)
    try:
        return build_model(config, dtype, "meta", resolved, **kwargs), resolved
    except ValueError as error:
        if quantization != "auto" or resolved != "fp8":
            raise
        logger.warning("model.quantization auto: keeping FP8 weights is not possible here (%s); dequantizing them",
                       error)
        return build_model(config, dtype, "meta", "none", **kwargs), "none"


def load_model(model_dir: str | Path, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               show_progress: bool = True, quantization: str = "none", **kwargs) -> nn.Module:
    """Build on the meta device, allocate each parameter once in its final dtype on `device`, and
    read into it the checkpoint tensors this process holds (see WeightLoader)."""
    dtype = resolve_dtype(dtype)
    hf, loader = open_weights(model_dir, show_progress=show_progress)
    config = config_from_hf(hf)
    fit_config = getattr(ARCHITECTURES[config.model_type][1], "fit_config", None)
    if fit_config is not None:
        config = fit_config(config, list(loader.files))
    model, _ = build_on_meta(config, dtype, quantization, hf, **kwargs)
    materialize(model, device)
    model.load_weights(loader)
    return model.eval().requires_grad_(False)


def load_tokenizer(model_dir: str | Path):
    """The model directory's HF tokenizer (a GGUF file's, from its metadata), or None when it ships
    none (token-id prompts only)."""
    gguf_file = gguf.find_gguf(model_dir)
    if gguf_file is not None:
        return gguf.load_tokenizer(gguf_file)
    path = Path(model_dir)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
