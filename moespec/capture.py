"""Capturing a step once and replaying it (`model.cuda_graph`, moespec.static_step.CapturedStep).

On CUDA a step is a CUDA graph: run twice on a side stream (lazy initialisation such as cuBLAS
workspaces stays out of the graph), then captured into a memory pool that every graph of the
model shares, and replayed with one launch. A replay does exactly what the capture recorded: the
same kernels, with the same arguments, on the same memory. Whatever the step decided on the host
while it was captured (a Python branch on a value, a shape, an `.item()`) is frozen, and inputs
must be copied into the captured buffers rather than passed anew.

Off CUDA there are no graphs. A captured step then runs its Python again at each replay, under
a check that it did what a graph replay would have done (`CheckedReplay`): the same aten ops in
the same order, with the same non-tensor arguments, reading the same memory wherever it read a
tensor it did not make itself, and never a device value on the host. That check is what the CPU
tests run, so a step that would replay wrongly on a GPU fails on the CPU.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

WARM_UP_RUNS = 2  # eager runs on a side stream before a CUDA graph is captured
# ops that read device values on the host (a sync, which capture refuses), or size their output
# by them; a CPU tensor's .tolist() reads its memory without an op (tests/test_sync_free.py's
# meta-device check covers that)
HOST_READS = {"aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique2",
              "aten::unique_consecutive", "aten::unique_dim"}


class CaptureError(RuntimeError):
    pass


def new_graphs(device: torch.device):
    """The graphs of one model: CUDA graphs on a CUDA device, checked replays elsewhere."""
    return CudaGraphs(device) if device.type == "cuda" else CheckedGraphs()


class CudaGraphs:
    """CUDA graphs sharing one memory pool (capture the largest batch first: the smaller ones
    then fit in what it allocated)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)  # every capture on the model's device (torch.cuda.graph's
        # own stream would be the current device's, whose capture records none of this model's kernels)

    def capture(self, fn) -> CudaReplay:
        with torch.cuda.device(self.device):  # the model's device is current while its kernels are captured
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(WARM_UP_RUNS):
                    fn()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: under overlap scheduling the helper thread keeps planning meanwhile
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                outputs = fn()
        return CudaReplay(graph, outputs)


class CudaReplay:
    def __init__(self, graph, outputs: tuple[torch.Tensor, ...]) -> None:
        self.graph, self.outputs = graph, outputs

    def replay(self) -> tuple[torch.Tensor, ...]:
        self.graph.replay()
        return self.outputs


class CheckedGraphs:
    def capture(self, fn) -> CheckedReplay:
        for _ in range(WARM_UP_RUNS):  # as before a CUDA graph: lazy work (FlashInfer's first plan) stays out
            fn()
        return CheckedReplay(fn)


class CheckedReplay:
    """A captured step off CUDA: each replay runs the step again and raises CaptureError where
    it differs from what was captured; its outputs are written into the captured outputs, as a
    graph writes them."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.outputs, self.ops = run_recorded(fn)
        self.replays = 0

    def replay(self) -> tuple[torch.Tensor, ...]:
        outputs, ops = run_recorded(self.fn)
        compare_ops(self.ops, ops)
        for captured, new in zip(self.outputs, outputs):
            captured.copy_(new)
        self.replays += 1
        return self.outputs


def run_recorded(fn) -> tuple[tuple, list]:
    recorder = OpRecorder()
    with recorder:
        outputs = fn()
    return outputs, recorder.ops


def compare_ops(captured: list, replayed: list) -> None:
    """Raise CaptureError at the first op a replay ran differently."""
    for i, (mine, theirs) in enumerate(zip(captured, replayed)):
        if mine != theirs:
            raise CaptureError(f"op {i} of the captured step differs at replay: captured {mine}, replayed {theirs}")
    if len(captured) != len(replayed):
        raise CaptureError(f"the captured step ran {len(captured)} ops, its replay {len(replayed)}")


class OpRecorder(TorchDispatchMode):
    """Records each aten op with its arguments: tensors the step made are named by shape and
    dtype alone, the others (weights, caches, input buffers) also by their memory."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []
        self.made: set[int] = set()  # storages the recorded ops allocated

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.name().split(".")[0] in HOST_READS:
            raise CaptureError(f"a captured step reads a device value on the host ({func}): .item(), int(), "
                               "bool() of a tensor, or a shape that depends on values")
        record = (str(func), tree_map(self.describe, (args, kwargs)))
        read = {storage_of(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        self.made.update(storage_of(t) for t in tree_flatten(out)[0]
                         if isinstance(t, torch.Tensor) and storage_of(t) not in read)
        self.ops.append(record)
        return out

    def describe(self, x):
        if isinstance(x, torch.ScriptObject):  # a collective's process group (wrapped anew at each call)
            return ("object", x._type().qualified_name())
        if not isinstance(x, torch.Tensor):
            return x
        layout = (tuple(x.shape), x.dtype)
        if x.is_mkldnn:  # an opaque packed weight (models.layers.PackedWeight): the object itself
            return ("packed", id(x), *layout)
        storage = storage_of(x)
        if storage in self.made or storage == 0:
            return ("made", *layout, x.stride())
        return ("read", storage, x.storage_offset(), *layout, x.stride())


def storage_of(t: torch.Tensor) -> int:
    return id(t) if t.is_mkldnn else t.untyped_storage().data_ptr()
