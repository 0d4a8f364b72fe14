"""What a measurement ran on: every benchmark's JSON (benchmarks/*.py, moespec bench) opens with
`run_info`, so a figure carries the CPU it came from: the date, the machine as the benchmark
words it (architecture, threads), the CPU's model name, the vector extensions torch's kernels use
(`torch.backends.cpu.get_cpu_capability()`) and whether oneDNN runs bfloat16 linears there
(models.layers.onednn_packs), with the variables that limit what torch uses where set
(ONEDNN_MAX_CPU_ISA, ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS: a run "as on" an older CPU)."""
from __future__ import annotations

import os
import platform
from datetime import date
from pathlib import Path

import torch

# what torch's kernels may use, where limited
LIMITS = ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")


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
