"""CUDA graphs for the embedded engine's decode step.

A decode step of a small batch is hundreds of small kernels; launching them one by one from Python
costs more than running them. ``DecodeGraphs`` captures ``model.decode(tokens, cache, width)``
once per (batch size, key width, cache buffers) and then replays it: one launch per token.

What makes replay correct is that everything the captured kernels read stays at one address:

- the KV cache, its FP8 scales and the sequence lengths live in ``StaticCacheStorage``, allocated
  once per engine; a batch shrinks in place (``KVCache.compact_``);
- the tokens fed to a step are copied into the graph's own input tensor;
- the RoPE table is the model's one (a graph is keyed by its address: a table rebuilt larger is
  captured again);
- the weights are refreshed in place at each sync (``LlamaForCausalLM.refresh_weights``), and when a
  refresh cannot be in place (a new shape) the graphs are dropped and captured again.

Capture follows torch's recipe: one eager step first, on the side stream the capture will use (the
step's real result; lazily initialised state -- a cuBLAS workspace for that stream, a Triton
kernel's first launch -- is set up there, before the capture, not during it; lengths are then reset
so the capture sees the same state), then the capture, then a replay -- which performs the step --
whose logits must equal the eager step's bit for bit. If capture fails or the replay
differs, graphs are switched off for the engine with the reason kept in ``disabled`` (reported by
``jetrl bench``), and decoding goes on eagerly: a graph never silently changes a sample.

Batch sizes and widths are bucketed (``width_bucket``, and the engine compacts to power-of-two
batch sizes on a GPU) so a rollout captures a handful of graphs, reused while weights keep their
shapes. The graphs of one batch size write their logits into one buffer (``outputs``): a step's
logits are read before the next step runs, and a graph's own output tensor would keep
batch x vocabulary fp32 values alive per graph (311 MB at 512 rows of a 152K vocabulary, times
the widths captured). Nothing here runs on CPU except under a test's stand-in for the capture API.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

WIDTH_BUCKET = 128


def width_bucket(width: int, limit: int) -> int:
    """The key width a captured step runs at: ``width`` rounded up to ``WIDTH_BUCKET``, at most ``limit``."""
    return min(limit, -(-width // WIDTH_BUCKET) * WIDTH_BUCKET)


@dataclass
class _Captured:
    graph: object
    tokens: torch.Tensor
    logits: torch.Tensor


class DecodeGraphs:
    """``decode(tokens, cache, width)`` through CUDA graphs, with an eager fallback."""

    def __init__(self, model, graph_api=None):
        self.model = model
        self.api = graph_api or _CudaGraphAPI()
        self.graphs: dict[tuple, _Captured] = {}
        self.disabled: str | None = None
        self.captures = 0
        self.pool = None
        self.outputs: dict[int, torch.Tensor] = {}  # batch size -> the logits buffer its graphs write

    def reset(self) -> None:
        """Drop every graph (the weights moved)."""
        self.graphs.clear()
        self.outputs.clear()
        self.pool = None

    def decode(self, tokens: torch.Tensor, cache, width: int) -> torch.Tensor:
        if self.disabled is not None:
            return self.model.decode(tokens, cache, width)
        rope = getattr(self.model, "_rope", None)  # the RoPE table, rebuilt larger past max_position_embeddings
        key = (tokens.shape[0], width, cache.kv.data_ptr(), cache.kv.stride(0), cache.lengths.data_ptr(),
               None if cache.scales is None else cache.scales.data_ptr(), None if rope is None else rope[0].data_ptr())
        hit = self.graphs.get(key)
        if hit is None:
            return self._capture(key, tokens, cache, width)
        hit.tokens.copy_(tokens)
        hit.graph.replay()
        return hit.logits

    def _capture(self, key, tokens, cache, width) -> torch.Tensor:
        static_tokens = tokens.clone()
        before = cache.lengths.clone()
        try:
            self.api.prepare()  # the capture's stream
        except Exception as e:  # no stream here (a machine without a usable driver): decode eagerly
            self.disabled = _why(e)
            return self.model.decode(tokens, cache, width)
        # the step itself, and the warm-up: on the capture's stream
        eager = self.api.warmup(lambda: self.model.decode(static_tokens, cache, width).clone())
        cache.lengths.copy_(before)
        try:
            if self.pool is None:
                self.pool = self.api.pool()
            graph = self.api.new_graph()
            frozen = copy.copy(cache)  # the cache's tensors as captured (later compaction rebinds `cache`)
            out = self.outputs.get(eager.shape[0])
            if out is None:  # allocated outside the capture: it outlives every graph of this batch size
                out = self.outputs[eager.shape[0]] = torch.empty_like(eager)
            logits = self.api.record(graph, self.pool, lambda: self.model.decode(static_tokens, frozen, width, out))
            graph.replay()  # performs the step again: same KV writes, lengths + 1
            self.captures += 1
        except Exception as e:  # a kernel that cannot be captured on this GPU / torch
            self.disabled = _why(e)
            cache.lengths.copy_(before + 1)
            return eager
        if not torch.equal(logits, eager):
            self.disabled = "a replayed decode step differed from the eager one"
            return eager
        self.graphs[key] = _Captured(graph, static_tokens, logits)
        return logits


def _why(e: Exception) -> str:
    return f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


class _CudaGraphAPI:
    def __init__(self):
        self.stream = None  # the side stream every warm-up and capture of this engine runs on

    def prepare(self) -> None:
        if self.stream is None:
            self.stream = torch.cuda.Stream()

    def pool(self):
        return torch.cuda.graph_pool_handle()

    def new_graph(self):
        return torch.cuda.CUDAGraph()

    def warmup(self, fn):
        """Run ``fn`` eagerly on the capture stream, after the work queued so far on the current
        stream and before what is queued next (both streams wait for each other). Memory it
        allocates is used on the current stream only after that wait."""
        self.prepare()
        current = torch.cuda.current_stream()
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            out = fn()
        current.wait_stream(self.stream)
        return out

    def record(self, graph, pool, fn):
        """Capture ``fn`` into ``graph`` on the warm-up's stream (nothing runs; torch synchronizes the
        device first); returns its output tensor, which every ``graph.replay()`` rewrites.

        cuBLAS (and cuBLASLt: ``matmul``, ``_scaled_mm``) runs with a workspace torch keeps per handle
        and stream, allocated at its first use: by the eager warm-up, outside the graph's memory pool.
        A captured GEMM keeps that address, but torch frees such workspaces whenever someone calls
        ``torch._C._cuda_clearCublasWorkspaces()`` -- ``torch.compile``'s CUDA graphs do, at every
        warm-up and recording (``transformers``' static-cache ``generate()``) -- and the next capture's
        ``empty_cache()`` hands the freed memory back to the driver: a later replay then reads and
        writes memory that is gone (the H100's "illegal memory access" beside ``transformers``, only
        once a second engine had captured). So, as torch's own CUDA-graph trees do, the workspaces
        are dropped before the capture, which then allocates its own inside the graph's pool (kept
        while the graph lives), and dropped again after it, so eager work never uses pool memory."""
        self.prepare()
        _clear_cublas_workspaces()
        try:
            with torch.cuda.graph(graph, pool=pool, stream=self.stream):
                return fn()
        finally:
            _clear_cublas_workspaces()


def _clear_cublas_workspaces() -> None:
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
