"""What a measurement ran on: every benchmark's JSON (benchmarks/*.py, moespec bench) opens with
`run_info`, so a figure carries the CPU it came from: the date, the machine as the benchmark
words it (architecture, threads), the CPU's model name, the vector extensions torch's kernels use
(`torch.backends.cpu.get_cpu_capability()`) and whether oneDNN runs bfloat16 linears there
(models.layers.onednn_packs), with the variables that limit what torch uses where set
(ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS: a run "as on" an older CPU)."""
from __future__ import annotations

import ctypes
import os
import platform
from datetime import date
from pathlib import Path

import torch

# what torch's kernels may use, where limited
LIMITS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MALLOC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "LD_PRELOAD")


def keep_freed_host_memory(trim_bytes: int = 512 << 20, mmap_bytes: int = 32 << 20) -> bool:
    """Have glibc's malloc keep the host memory a step frees for the next step rather than hand it
    back to the system and fault it in again. A CPU step allocates and frees its activations
    (hundreds of MB at batch 64), and with glibc's defaults much of that went back to the system
    each step: 9,200 page faults per SmolLM2 decode step at batch 64, none with this. Freed
    memory stays in the heap up to `trim_bytes`, and blocks below `mmap_bytes` (the largest
    glibc takes) come from the heap, not mappings of their own. Process-wide, once; skipped
    where the malloc is set up otherwise (its variables, a preloaded allocator) or is not
    glibc's. Returns whether it applied."""
    if platform.system() != "Linux" or any(name in os.environ for name in MALLOC_VARIABLES):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_TRIM_THRESHOLD, trim_bytes)) and bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_bytes))
    except (OSError, AttributeError):
        return False


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def run_info(machine: str) -> dict:
    """The fields that open a benchmark's report; `machine`: architecture, threads or cores."""
    from moespec.models.layers import onednn_packs

    return {"date": str(date.today()), "machine": machine, "cpu": cpu_model(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "onednn_bfloat16": onednn_packs(torch.bfloat16),
            **{name: os.environ[name] for name in LIMITS if name in os.environ}}
