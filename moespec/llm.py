"""Offline generation API, shaped like vLLM's: `LLM(model=...)`, `llm.generate(prompts, params)`."""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence as Seq

from tqdm import tqdm

from moespec.config import EngineConfig, build_config, load_config
from moespec.startup import start_engine
from moespec.outputs import CompletionOutput, RequestOutput
from moespec.sampling import SamplingParams

Prompt = str | list[int]


class LLM:
    """LLM(model=PATH, dtype="float32", page_size=..., num_kv_pages=..., max_num_seqs=...,
    max_num_batched_tokens=..., max_model_len=..., seed=..., speculation={...}, parallel={...})."""

    def __init__(self, model: str | None = None, dtype: str | None = None, *, config: EngineConfig | None = None,
                 **engine_options: Any) -> None:
        if config is None:
            options = {k: v for k, v in {"model": model, "dtype": dtype, **engine_options}.items() if v is not None}
            config = build_config({}, options)
        self.config = config
        self.engine = start_engine(config)  # under torchrun, ranks other than 0 serve inside and exit

    def close(self) -> None:
        self.engine.close()

    @classmethod
    def from_config(cls, path: str | Path, **overrides: Any) -> "LLM":
        return cls(config=load_config(path, overrides))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = as_prompt_list(prompts)
        params_list = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"params: got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        groups = [self.add(prompt, p) for prompt, p in zip(prompts, params_list)]
        total = sum(len(g) for g in groups)
        with tqdm(total=total, desc="generating", unit="req", disable=not use_tqdm) as bar:
            done = 0
            while self.engine.has_unfinished():
                self.engine.step()
                finished = sum(s.is_finished for g in groups for s in g)
                bar.update(finished - done)
                done = finished
        return [self.collect(prompt, group) for prompt, group in zip(prompts, groups)]

    def add(self, prompt: Prompt, params: SamplingParams) -> list:
        """n completions are n sequences; seeded ones get seeds seed, seed+1, ..."""
        base = f"gen-{next(self.engine.requests.ids)}"
        return [self.engine.add_request(prompt, child_params(params, i), f"{base}-{i}") for i in range(params.n)]

    @staticmethod
    def collect(prompt: Prompt, group: list) -> RequestOutput:
        outputs = [CompletionOutput.from_sequence(i, seq) for i, seq in enumerate(group)]
        request_id = group[0].request_id.rsplit("-", 1)[0]
        return RequestOutput(request_id, prompt if isinstance(prompt, str) else None, group[0].prompt_ids, outputs,
                             group[0].prompt_logprobs)


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    if params.n == 1:
        return params
    seed = None if params.seed is None else params.seed + index
    return dataclasses.replace(params, n=1, seed=seed)


def as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts
