"""HF model directories: config.json access, safetensors reading (single or sharded) and loading
tensors into a model with clear errors.

Tensors are read with positioned reads straight into the parameters they belong to, only those
this process holds; FP8 weights stay FP8 where the model keeps them so (models.fp8) and are
dequantized with their 128x128 block scales where it does not."""
from __future__ import annotations

import fnmatch
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from moespec.models.errors import WeightError
from moespec.models.fp8 import FP8_DTYPES, dequantize_fp8_block, is_fp8
from moespec.models.gguf import GGUFCheckpoint, find_gguf, open_checkpoint
from moespec.models.layers import merged_aliases

SCALE_SUFFIX = "_scale_inv"
HEADER_LIMIT = 100_000_000  # safetensors refuses larger headers
SAFETENSORS_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError)


@dataclass(frozen=True)
class KVSpec:
    """KV cache layout of one attention layer: kv heads, key dim, value dim (None: values are keys[..., :v_dim])."""

    num_kv_heads: int
    k_dim: int
    v_dim: int
    separate_v: bool = True


def hf_get(hf: dict, key: str):
    if key not in hf:
        raise WeightError(f"config.json is missing required key {key!r}")
    return hf[key]


def hf_eos_ids(hf: dict) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def read_hf_config(model_dir: str | Path) -> dict:
    """config.json of a model directory, or the same keys from a GGUF file's metadata."""
    gguf = find_gguf(model_dir)
    if gguf is not None:
        return dict(open_checkpoint(gguf).hf_config)
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"model directory {str(model_dir)!r} has no config.json")
    return read_json(path)


def read_json(path: Path) -> dict:
    """A JSON object file; anything else is a WeightError naming the file (and line and column)."""
    try:
        data = json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise WeightError(f"{path} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from e
    except UnicodeDecodeError as e:
        raise WeightError(f"{path} is not valid JSON: not UTF-8 text ({e})") from e
    if not isinstance(data, dict):
        raise WeightError(f"{path} is not a JSON object")
    return data


def describe_damage(path: Path) -> str:
    """What is wrong with a safetensors file that safetensors refused, in plain words."""
    size = path.stat().st_size
    if size < 8:
        return f"is truncated: {size} bytes, too short for a safetensors header"
    with path.open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        if header_len > HEADER_LIMIT:
            return f"has a corrupt header: its length field says {header_len} bytes, more than safetensors allows"
        if 8 + header_len > size:
            return f"is truncated or has a corrupt header: a {header_len}-byte header, but the file has {size} bytes"
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return "has a corrupt header: it is not a valid safetensors JSON header"
    expected = 8 + header_len + end
    if size < expected:
        return f"is truncated: {size} bytes, its header describes {expected}"
    if size > expected:
        return f"is corrupt: {size - expected} unexpected bytes after its last tensor"
    return "has a corrupt header"


SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                      "F8_E5M2": torch.float8_e5m2}


@dataclass(frozen=True)
class TensorEntry:
    """Where a tensor's bytes are: its file and absolute byte range, dtype and shape."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def check_safetensors(path: Path) -> None:
    """Let safetensors validate the file (it reads the header only); its errors become WeightErrors
    naming the file and what is wrong with it."""
    if not path.exists():
        raise WeightError(f"checkpoint file {path} is missing")
    if not path.is_file():
        raise WeightError(f"checkpoint file {path} is not a file")
    try:
        handle = safe_open(str(path), "pt")
    except SafetensorError as e:
        raise WeightError(f"checkpoint file {path} {describe_damage(path)} ({e})") from e
    except SAFETENSORS_ERRORS as e:
        raise WeightError(f"cannot open checkpoint file {path} ({e})") from e
    with handle:
        pass


def read_entries(path: Path) -> dict[str, TensorEntry]:
    """Every tensor of a safetensors file, from its header (validated by safetensors first)."""
    check_safetensors(path)
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    base, entries = 8 + length, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = SAFETENSORS_DTYPES.get(info["dtype"])
        if dtype is None:
            raise WeightError(f"checkpoint file {path}: tensor {name!r} has dtype {info['dtype']}, which is not "
                              f"supported; supported: {', '.join(SAFETENSORS_DTYPES)}")
        start, end = info["data_offsets"]
        entries[name] = TensorEntry(path, dtype, tuple(info["shape"]), base + start, base + end)
    return entries


def read_bytes(entry: TensorEntry, out: torch.Tensor) -> None:
    """Fill a contiguous CPU tensor of the entry's dtype and size with positioned reads: the bytes
    land in `out` alone (no mapping of the file, no intermediate copy)."""
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    if len(view) != entry.end - entry.start:
        raise WeightError(f"checkpoint file {entry.path}: a tensor of {entry.end - entry.start} bytes does not fit "
                          f"{len(view)} bytes")
    fd = os.open(entry.path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], entry.start + done)
            if n == 0:
                raise WeightError(f"checkpoint file {entry.path} is truncated: a tensor ends at byte {entry.end}")
            done += n
    finally:
        os.close(fd)


class WeightLoader:
    """Reads a model directory's safetensors (single or sharded) tensor by tensor into a model.

    Only the tensors a model asks for are read (another rank's experts never are), each straight
    into its parameter when dtype and device allow, else through one temporary of that tensor;
    files are never mapped or read whole.
    """

    def __init__(self, model_dir: str | Path, show_progress: bool = True) -> None:
        self.model_dir = Path(model_dir)
        self.show_progress = show_progress
        self.entries: dict[Path, dict[str, TensorEntry]] = {}
        self.files = self.index_files()

    def index_files(self) -> dict[str, Path]:
        """tensor name -> file holding it."""
        index = self.model_dir / "model.safetensors.index.json"
        if index.is_file():
            return self.read_index(index)
        files = sorted(self.model_dir.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"model directory {str(self.model_dir)!r} has no *.safetensors files")
        names = {}
        for file in files:
            self.entries[file] = read_entries(file)
            names.update({name: file for name in self.entries[file]})
        return names

    def read_index(self, index: Path) -> dict[str, Path]:
        """tensor name -> shard, from a sharded checkpoint's index; every shard must exist."""
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise WeightError(f"{index} has no \"weight_map\" object mapping tensor names to files")
        files = {name: self.model_dir / file for name, file in weight_map.items()}
        self.check_shards(index, Counter(files.values()))
        return files

    def check_shards(self, index: Path, tensor_counts: Counter[Path]) -> None:
        missing = [f"{shard.name} ({n} tensor{'s' if n != 1 else ''})"
                   for shard, n in tensor_counts.items() if not shard.is_file()]
        if missing:
            raise WeightError(f"{index.name} lists {', '.join(missing)}, which "
                              f"{'is' if len(missing) == 1 else 'are'} not in {self.model_dir}")

    # ------------------------------------------------------------------ reading

    def entry(self, name: str) -> TensorEntry:
        path = self.files[name]
        if path not in self.entries:
            self.entries[path] = read_entries(path)
        found = self.entries[path].get(name)
        if found is None:
            raise WeightError(f"checkpoint file {path} has no tensor {name!r}")
        return found

    def read(self, name: str) -> torch.Tensor:
        """A checkpoint tensor as stored, in a new CPU tensor."""
        entry = self.entry(name)
        out = torch.empty(entry.shape, dtype=entry.dtype, device="cpu")
        read_bytes(entry, out)
        return out

    def read_into(self, name: str, dest: torch.Tensor) -> None:
        """Checkpoint tensor `name` into `dest` (a parameter or a view of one). An FP8 tensor going
        into a non-FP8 `dest` is dequantized with its block scales."""
        entry = self.entry(name)
        if tuple(entry.shape) != tuple(dest.shape):
            raise WeightError(f"tensor {name!r} has shape {tuple(entry.shape)}, expected {tuple(dest.shape)}")
        if is_fp8(dest) and entry.dtype != dest.dtype:
            raise WeightError(f"tensor {name!r} is {entry.dtype}, but the model keeps this weight in {dest.dtype}; "
                              "set model.quantization: none")
        if entry.dtype in FP8_DTYPES and not is_fp8(dest):
            value = dequantize_fp8_block(self.read(name), self.read(self.scale_of(name)), dest.dtype)
        elif entry.dtype == dest.dtype and dest.device.type == "cpu" and dest.is_contiguous():
            read_bytes(entry, dest.detach())
            return
        else:
            value = self.read(name)
        with torch.no_grad():
            dest.copy_(value.to(dest.dtype))

    def scale_of(self, name: str) -> str:
        scale = name + SCALE_SUFFIX
        if scale not in self.files:
            raise WeightError(f"FP8 tensor {name!r} has no block scale {scale!r}")
        return scale

    def equals(self, name: str, tensor: torch.Tensor, rows_per_read: int = 4096) -> bool:
        """Whether checkpoint tensor `name`, in `tensor`'s dtype, equals `tensor`; read a few rows at
        a time, so no copy of the whole tensor is made."""
        entry = self.entry(name)
        if tuple(entry.shape) != tuple(tensor.shape) or entry.dtype in FP8_DTYPES or not entry.shape:
            return False
        row_bytes = (entry.end - entry.start) // max(entry.shape[0], 1)
        for first in range(0, entry.shape[0], rows_per_read):
            rows = min(rows_per_read, entry.shape[0] - first)
            part = torch.empty((rows, *entry.shape[1:]), dtype=entry.dtype)
            start = entry.start + first * row_bytes
            read_bytes(TensorEntry(entry.path, entry.dtype, tuple(part.shape), start, start + rows * row_bytes), part)
            if not torch.equal(part.to(tensor.dtype), tensor[first: first + rows].cpu()):
                return False
        return True

    # ------------------------------------------------------------------ loading a model

    def load_into(self, model: nn.Module, rename: Callable[[str], str | None] = lambda n: n,
                  ignore_missing: tuple[str, ...] = (), ignore_unexpected: tuple[str, ...] = (),
                  checkpoint_name: Callable[[str], str] = lambda n: n,
                  capture: Callable[[str], bool] = lambda n: False) -> list[str]:
        """Read every checkpoint tensor the model holds into it; missing/unexpected/mis-shaped ->
        WeightError. Returns the names `capture` kept for the model to handle itself.

        `rename` maps a checkpoint name to a parameter name (None: skip on purpose; the parts of
        merged projections then map to their MergedLinear) and `checkpoint_name` maps back for
        error messages. A parameter with a `weight_loader(param, ckpt_name) -> view | None`
        attribute (stacked experts, merged parts) says where each of its checkpoint tensors goes
        (None: it belongs to another rank and is not read) and how many it expects in `num_loads`.
        Block scales of weights the model keeps dequantized are read with their weights.
        """
        targets = dict(model.named_parameters())
        targets.update(model.named_buffers())
        aliases = merged_aliases(model)  # q_proj/k_proj/v_proj -> qkv_proj, gate_proj/up_proj -> gate_up_proj
        loaded: Counter[str] = Counter()
        merged_parts_loaded: set[str] = set()
        captured: list[str] = []
        for name in tqdm(list(self.files), desc="loading weights", unit="tensor", disable=not self.show_progress):
            if capture(name):
                captured.append(name)
                continue
            target = rename(name)
            if target is None:
                continue
            if target in aliases:
                merged_parts_loaded.add(target)
                target = aliases[target]
            param = targets.get(target)
            if param is None:
                if name.endswith(SCALE_SUFFIX) or any(fnmatch.fnmatch(name, p) for p in ignore_unexpected):
                    continue
                raise WeightError(f"unexpected tensor {name!r} in checkpoint {str(self.model_dir)!r}")
            locate = getattr(param, "weight_loader", None)
            dest = param if locate is None else locate(param, name)
            if dest is not None:
                self.read_into(name, dest)
                loaded[target] += 1
        missing = []
        for n, p in targets.items():
            if loaded[n] >= getattr(p, "num_loads", 1) or any(fnmatch.fnmatch(n, pat) for pat in ignore_missing):
                continue
            parts = [a for a, merged in aliases.items() if merged == n and a not in merged_parts_loaded]
            missing += [checkpoint_name(a) for a in parts] or [f"{checkpoint_name(n)} {tuple(p.shape)}"]
        if missing:
            raise WeightError(f"checkpoint {str(self.model_dir)!r} is missing tensors for: {', '.join(missing[:8])}"
                              + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
        return captured


class GGUFLoader(WeightLoader):
    """A WeightLoader over one GGUF file: its tensors under HF names, each dequantized as it is read."""

    def __init__(self, checkpoint: GGUFCheckpoint, show_progress: bool = True) -> None:
        self.model_dir = checkpoint.path
        self.show_progress = show_progress
        self.checkpoint = checkpoint
        self.entries = {}
        self.files = {name: checkpoint.path for name in checkpoint.tensors}

    def entry(self, name: str) -> TensorEntry:
        raise WeightError(f"{self.model_dir}: tensor {name!r} is GGUF-encoded and has no raw byte range")

    def read(self, name: str) -> torch.Tensor:
        return self.checkpoint.read(name, torch.float32)

    def read_into(self, name: str, dest: torch.Tensor) -> None:
        shape = self.checkpoint.shape(name)
        if shape != tuple(dest.shape):
            raise WeightError(f"tensor {name!r} has shape {shape}, expected {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(self.checkpoint.read(name, dest.dtype))


def open_weights(model_dir: str | Path, show_progress: bool = True) -> tuple[dict, WeightLoader]:
    """A model's config.json dict and a loader for its tensors: an HF directory's safetensors, or a GGUF file."""
    gguf = find_gguf(model_dir)
    if gguf is None:
        return read_hf_config(model_dir), WeightLoader(model_dir, show_progress)
    checkpoint = open_checkpoint(gguf)
    return dict(checkpoint.hf_config), GGUFLoader(checkpoint, show_progress)
