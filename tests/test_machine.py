"""The host allocator set up for serving (`moespec.machine.keep_freed_host_memory`): memory a step
frees is kept for the next one, not handed back and faulted in again."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

ROUNDS = """
import resource, torch
from moespec.machine import keep_freed_host_memory
torch.set_num_threads(1)
applied = keep_freed_host_memory()
def one_round():  # a step's activations: 64 MB in 8 MB tensors, allocated, then freed
    blocks = [torch.ones(2 << 20) for _ in range(8)]
    del blocks
one_round(); one_round()
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    one_round()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, sorted(faults)[2])
"""


def faults_per_round(**env: str) -> tuple[bool, int]:
    """In a fresh process: whether the setting applied, and the median page faults of 5 rounds
    after two. The median, as some processes grow the heap once more, by one 8 MB block (2,048
    faults), in the first of those rounds and in none after it."""
    environ = {**os.environ, "PYTHONPATH": os.getcwd(), **env}
    out = subprocess.run([sys.executable, "-c", ROUNDS], env=environ, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(platform.system() != "Linux", reason="glibc's malloc")
def test_freed_host_memory_is_reused_without_page_faults():
    """With the setting a step's 64 MB come back from the heap (no page faults in a round, in every
    process); glibc's defaults hand them back to the system and fault in all 16,384 pages again,
    every round (in about 3 processes of 4; in the others they stay, so up to 5 are tried). A
    preloaded allocator or malloc variables of the user's own leave it off."""
    for _ in range(3):
        applied, faults = faults_per_round()
        assert applied and faults < 100, faults
    defaults = []
    while len(defaults) < 5 and max(defaults, default=0) <= 10_000:
        skipped, faults = faults_per_round(LD_PRELOAD="")
        assert not skipped
        defaults.append(faults)
    assert max(defaults) > 10_000, defaults
