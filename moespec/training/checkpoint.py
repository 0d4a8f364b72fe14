"""Saving trained models as HF model directories (bfloat16 safetensors in the released tensor
names, readable by `load_model` and by transformers) and the resumable training state."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from moespec.models import ARCHITECTURES
from moespec.models.layers import unmerge_tensors
from moespec.training.tokenizer import BOS_ID, EOS_ID, PAD_ID

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
STATE_FILE = "training_state.pt"


# Written out even when the preset leaves them to defaults: our config and transformers' disagree
# on some defaults (e.g. DeepSeek's routed_scaling_factor 1.0 vs 2.5, n_shared_experts 0 vs 1).
EXPLICIT_KEYS = {
    "deepseek_v3": ("routed_scaling_factor", "n_shared_experts", "norm_topk_prob", "n_group", "topk_group",
                    "first_k_dense_replace", "num_nextn_predict_layers", "max_position_embeddings", "rms_norm_eps",
                    "rope_interleave", "attention_bias"),
    "llama": ("num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "attention_bias",
              "mlp_bias"),
}


def hf_config(preset: dict) -> dict:
    """The preset's HF config with every model-defining key explicit, plus the tokenizer's special
    ids and the stored dtype."""
    config = dict(preset)
    parsed = ARCHITECTURES[preset["model_type"]][0].from_hf(preset)
    for key in EXPLICIT_KEYS.get(preset["model_type"], ()):
        config.setdefault(key, getattr(parsed, key))
    if preset["model_type"] == "deepseek_v3":
        config.setdefault("num_key_value_heads", preset["num_attention_heads"])
    config.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, torch_dtype="bfloat16")
    return config


def export_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our parameter names -> the released checkpoint names (experts split per expert, MTP layers
    at model.layers.{L+i}). An MTP layer's embed_tokens / shared_head.head are written only when
    they differ from the target's: shared ones (as after joint training) would be 4 MB of
    duplicates here, and the loader shares the target's tensors when the copies are absent."""
    config = model.config
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in unmerge_tensors(model, model.state_dict()).items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        for out_name, part in split_experts(name, tensor):
            tensors[rename_mtp(out_name, config.num_hidden_layers)] = part
    for index in range(getattr(model, "num_mtp_layers", 0)):
        prefix = f"model.layers.{config.num_hidden_layers + index}."
        if model.mtp_embeds[index] is not model.model.embed_tokens:
            tensors[prefix + "embed_tokens.weight"] = model.mtp_embeds[index].weight.detach()
        if model.mtp_heads[index] is not model.lm_head:
            tensors[prefix + "shared_head.head.weight"] = model.mtp_heads[index].weight.detach()
    return {name: t.detach().to(torch.bfloat16).contiguous().clone() for name, t in tensors.items()}


def split_experts(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Stacked w13 [E, 2I, M] / w2 [E, M, I] -> one gate/up/down matrix per expert."""
    if name.endswith(".experts.w13"):
        prefix = name[: -len("w13")]
        gates, ups = tensor.chunk(2, dim=1)  # [E, I, M] each
        return [pair for e in range(tensor.shape[0]) for pair in
                ((f"{prefix}{e}.gate_proj.weight", gates[e]), (f"{prefix}{e}.up_proj.weight", ups[e]))]
    if name.endswith(".experts.w2"):
        prefix = name[: -len("w2")]
        return [(f"{prefix}{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
    return [(name, tensor)]


def rename_mtp(name: str, num_hidden_layers: int) -> str:
    match = re.match(r"mtp\.(\d+)\.(.*)", name)
    return name if match is None else f"model.layers.{num_hidden_layers + int(match.group(1))}.{match.group(2)}"


def save_hf_model(model: nn.Module, preset: dict, out_dir: Path, tokenizer_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(export_tensors(model), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(hf_config(preset), indent=2) + "\n")
    copy_tokenizer(tokenizer_dir, out_dir)


def copy_tokenizer(tokenizer_dir: Path, out_dir: Path) -> None:
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, out_dir / name)


def save_training_state(out_dir: Path, state: dict) -> None:
    """Full-precision weights, optimizer, step and clock; written atomically (tmp file + rename)."""
    tmp = out_dir / (STATE_FILE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(out_dir / STATE_FILE)


def load_training_state(out_dir: Path) -> dict:
    path = Path(out_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--resume: {str(out_dir)!r} has no {STATE_FILE}; train without --resume first")
    return torch.load(path, map_location="cpu", weights_only=False)
