"""HF model directories: config.json access, safetensors reading (single or sharded, FP8 block
scales dequantized on CPU) and loading tensors into a model with clear errors."""
from __future__ import annotations

import fnmatch
import json
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from moespec.models.layers import dequantize_fp8_block, merged_aliases

SCALE_SUFFIX = "_scale_inv"
HEADER_LIMIT = 100_000_000  # safetensors refuses larger headers
SAFETENSORS_ERRORS = (SafetensorError, OSError, ValueError, RuntimeError)


class WeightError(ValueError):
    """A checkpoint is damaged or does not match the model: names the file or tensor and the problem."""


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


class SafetensorsFile:
    """An open safetensors file whose read errors name the file and the tensor."""

    def __init__(self, path: Path, handle) -> None:
        self.path = path
        self.handle = handle

    def keys(self) -> list[str]:
        return self.handle.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        try:
            return self.handle.get_tensor(name)
        except SAFETENSORS_ERRORS as e:
            if name not in self.handle.keys():
                raise WeightError(f"checkpoint file {self.path} has no tensor {name!r} ({e})") from e
            if "end of file" in str(e).lower():
                raise WeightError(f"checkpoint file {self.path} is truncated: tensor {name!r} runs past its end "
                                  f"({e})") from e
            raise WeightError(f"cannot read tensor {name!r} from {self.path} ({e})") from e


@contextmanager
def open_safetensors(path: Path) -> Iterator[SafetensorsFile]:
    """safe_open whose errors are WeightErrors naming the file and what is wrong with it."""
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
        yield SafetensorsFile(path, handle)


class WeightLoader:
    """Streams (name, tensor) pairs from a model directory's safetensors files."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype, show_progress: bool = True) -> None:
        self.model_dir = Path(model_dir)
        self.dtype = dtype
        self.show_progress = show_progress
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
            with open_safetensors(file) as f:
                names.update({name: file for name in f.keys()})
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

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        names = [n for n in self.files if not n.endswith(SCALE_SUFFIX)]
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[name], []).append(name)
        bar = tqdm(total=len(names), desc="loading weights", unit="tensor", disable=not self.show_progress)
        for file, file_names in by_file.items():
            with open_safetensors(file) as f:
                for name in file_names:
                    yield name, self.read(f, name)
                    bar.update(1)
        bar.close()

    def read(self, f: SafetensorsFile, name: str) -> torch.Tensor:
        tensor = f.get_tensor(name)
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale_name = name + SCALE_SUFFIX
            if scale_name not in self.files:
                raise WeightError(f"FP8 tensor {name!r} has no block scale {scale_name!r}")
            with open_safetensors(self.files[scale_name]) as sf:
                return dequantize_fp8_block(tensor, sf.get_tensor(scale_name), self.dtype)
        return tensor

    def load_into(self, model: nn.Module, rename: Callable[[str], str | None] = lambda n: n,
                  ignore_missing: tuple[str, ...] = (), ignore_unexpected: tuple[str, ...] = (),
                  checkpoint_name: Callable[[str], str] = lambda n: n,
                  capture: Callable[[str], bool] = lambda n: False) -> dict[str, torch.Tensor]:
        """Copy every checkpoint tensor into the model; missing/unexpected/mis-shaped -> WeightError.

        `rename` maps a checkpoint name to a parameter name (None: skip on purpose; the parts of
        merged projections then map to their MergedLinear) and
        `checkpoint_name` maps back for error messages; tensors for which `capture` is true are
        returned instead of loaded. A parameter
        with a `weight_loader(param, tensor, ckpt_name) -> bool` attribute (stacked experts) loads
        its parts itself and declares how many parts it expects in `num_loads`.
        """
        targets = dict(model.named_parameters())
        targets.update(model.named_buffers())
        aliases = merged_aliases(model)  # q_proj/k_proj/v_proj -> qkv_proj, gate_proj/up_proj -> gate_up_proj
        loaded: Counter[str] = Counter()
        merged_parts_loaded: set[str] = set()
        captured: dict[str, torch.Tensor] = {}
        for name, tensor in self.tensors():
            if capture(name):
                captured[name] = tensor
                continue
            target = rename(name)
            if target is None:
                continue
            if target in aliases:
                merged_parts_loaded.add(target)
                target = aliases[target]
            param = targets.get(target)
            if param is None:
                if any(fnmatch.fnmatch(name, p) for p in ignore_unexpected):
                    continue
                raise WeightError(f"unexpected tensor {name!r} in checkpoint {str(self.model_dir)!r}")
            loader = getattr(param, "weight_loader", None)
            if loader is not None:
                loaded[target] += int(loader(param, tensor, name))
                continue
            if tuple(tensor.shape) != tuple(param.shape):
                raise WeightError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor.to(param.dtype))
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
