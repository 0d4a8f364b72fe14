"""GGUF checkpoints (llama.cpp's one-file format): config, tokenizer and weights from one file.

`model.path` may name a `.gguf` file, or a directory that holds one (and no config.json). The
file's metadata is everything a model directory's JSON files would be: `GGUFCheckpoint.hf_config`
turns llama.cpp's keys into the config.json dict moespec's models read, and transformers builds
the tokenizer, its special tokens and its chat template from the same metadata (`load_tokenizer`).

Tensors are read one at a time, under their HF names: the gguf package's `quants.dequantize`
turns the quantized blocks into float32 (the file stays memory-mapped by GGUFReader, so no second
copy of it is made), then the tensor is cast into the model dtype. llama.cpp's exporter permutes
the rows of q_proj and k_proj (its rotary embedding rotates adjacent pairs, HF's rotates halves);
`unpermute_rows` undoes that as transformers' LlamaTensorProcessor does.

Shapes legend: H heads (query or kv), D head dim, M hidden.
"""
from __future__ import annotations

import re
from functools import cached_property, lru_cache
from pathlib import Path

import torch

ARCHITECTURES = ("llama",)
# llama.cpp tensor name -> HF name ("{}": the block index)
LLAMA_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}
BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


class GGUFError(ValueError):
    """A GGUF file that cannot be loaded: names the file and what is wrong (one line)."""


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: itself if it ends in .gguf, else the one .gguf file of a
    directory without config.json; None for an HF model directory."""
    path = Path(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise GGUFError(f"GGUF file {str(path)!r} does not exist")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        raise GGUFError(f"model directory {str(path)!r} holds {len(found)} GGUF files "
                        f"({', '.join(f.name for f in found)}); name one of them")
    return found[0] if found else None


def import_gguf():
    try:
        import gguf
    except ImportError as e:
        raise GGUFError(f"reading GGUF files needs the gguf package (pip install gguf): {e}") from e
    return gguf


def llama_name(gguf_name: str) -> str:
    """The HF name of a llama.cpp Llama tensor; an unknown name is returned as it is (and is then
    reported as an unexpected tensor)."""
    block = BLOCK.match(gguf_name)
    key, index = (f"blk.{{}}.{block.group(2)}", block.group(1)) if block else (gguf_name, "")
    return LLAMA_NAMES[key].format(index) if key in LLAMA_NAMES else gguf_name


def unpermute_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order: within each head, rows (pair i, element j) go back to
    (half j, index i). weight [H*D, M]."""
    rows = weight.shape[0]
    halves = weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:])  # [H, D/2, 2, M]
    return halves.transpose(1, 2).reshape(weight.shape)  # [H*D, M]


class GGUFCheckpoint:
    """One GGUF file, memory-mapped: its metadata as an HF config dict and its tensors by HF name."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.gguf = import_gguf()
        self.reader = self.open_reader()
        self.architecture = self.field("general.architecture")
        if self.architecture not in ARCHITECTURES:
            raise GGUFError(f"GGUF file {self.path}: architecture {self.architecture!r} is not supported; "
                            f"supported: {', '.join(ARCHITECTURES)}")
        self.tensors = {llama_name(t.name): t for t in self.reader.tensors}
        self.check_quantization()

    def open_reader(self):
        with self.path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise GGUFError(f"{self.path} is not a GGUF file: it does not start with the GGUF magic")
        try:
            return self.gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the reader raises ValueError, IndexError, struct and numpy errors alike
            raise GGUFError(f"GGUF file {self.path} is truncated or damaged ({self.path.stat().st_size} bytes): "
                            f"{type(e).__name__}: {e}") from e

    def field(self, key: str, default=None):
        found = self.reader.get_field(key)
        return default if found is None else found.contents()

    def arch_field(self, key: str, default=None):
        value = self.field(f"{self.architecture}.{key}", default)
        if value is None:
            raise GGUFError(f"GGUF file {self.path} is missing metadata key {self.architecture}.{key!r}")
        return value

    @cached_property
    def hf_config(self) -> dict:
        """config.json's keys for moespec's Llama, as transformers reads them from this file."""
        heads = self.arch_field("attention.head_count")
        hidden = self.arch_field("embedding_length")
        self.check_rope()
        return {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"],
            "vocab_size": self.vocab_size(), "hidden_size": hidden,
            "intermediate_size": self.arch_field("feed_forward_length"),
            "num_hidden_layers": self.arch_field("block_count"), "num_attention_heads": heads,
            "num_key_value_heads": self.arch_field("attention.head_count_kv", heads),
            "head_dim": self.arch_field("rope.dimension_count", hidden // heads),
            "max_position_embeddings": self.arch_field("context_length", 2048),
            "rms_norm_eps": self.arch_field("attention.layer_norm_rms_epsilon"),
            "rope_theta": self.arch_field("rope.freq_base", 10000.0),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
        }

    def vocab_size(self) -> int:
        size = self.field(f"{self.architecture}.vocab_size")
        if size is None:
            tokens = self.reader.get_field("tokenizer.ggml.tokens")
            if tokens is None:
                raise GGUFError(f"GGUF file {self.path} has neither {self.architecture}.vocab_size nor a vocabulary")
            size = len(tokens.data)
        return int(size)

    def check_rope(self) -> None:
        scaling = self.field(f"{self.architecture}.rope.scaling.type", "none")
        if scaling != "none" or "rope_freqs.weight" in self.tensors:
            raise GGUFError(f"GGUF file {self.path}: rope scaling {scaling if scaling != 'none' else 'rope_freqs'!r} "
                            "is not supported; supported: none")

    # ------------------------------------------------------------------ tensors

    def check_quantization(self) -> None:
        """Dequantize one row of a tensor of each type present, so that a type the gguf package
        cannot read is an error before anything is allocated."""
        first_of_type = {t.tensor_type: t for t in reversed(self.reader.tensors)}
        for qtype, tensor in first_of_type.items():
            try:
                self.gguf.quants.dequantize(tensor.data[:1], qtype)
            except NotImplementedError as e:
                raise GGUFError(f"GGUF file {self.path}: tensor {tensor.name!r} has quantization type {qtype.name}, "
                                "which the gguf package cannot dequantize") from e

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(n) for n in reversed(self.tensors[name].shape))  # GGUF lists dims innermost first

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Tensor `name` (an HF name) dequantized by the gguf package, in HF's layout and `dtype`."""
        tensor = self.tensors[name]
        values = self.gguf.quants.dequantize(tensor.data, tensor.tensor_type)  # a float32 array
        if not values.flags.writeable:  # an unquantized tensor is a view of the read-only mapping
            values = values.copy()
        weight = torch.from_numpy(values).reshape(self.shape(name)).to(dtype)
        if ".self_attn.q_proj." in name:
            return unpermute_rows(weight, self.hf_config["num_attention_heads"])
        if ".self_attn.k_proj." in name:
            return unpermute_rows(weight, self.hf_config["num_key_value_heads"])
        return weight


def open_checkpoint(path: str | Path) -> GGUFCheckpoint:
    """The file's GGUFCheckpoint, parsed once while it is unchanged: parsing a vocabulary's worth
    of metadata takes seconds, and config, memory plan and weights all read the same file."""
    path = Path(path).resolve()
    stat = path.stat()
    return cached_checkpoint(path, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=4)
def cached_checkpoint(path: Path, mtime_ns: int, size: int) -> GGUFCheckpoint:
    return GGUFCheckpoint(path)


def load_tokenizer(path: Path):
    """transformers' tokenizer built from the file's metadata: vocabulary, merges, special tokens
    and chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
