"""CUDA graphs per SM budget: captured on the budget's green stream, replayed there.

    GreenPartitions.by_budget() ─► {σ: Partition} ─► BudgetGraphs
        capture(fn, batch_sizes): per σ, per batch size (largest first)
            warm fn up on σ's stream ─► torch.cuda.graph(g, stream=σ's stream, pool=shared)
            memory before/after the capture ─► GraphMemory of (σ, batch size)
        replay(σ, batch_size) ─► g.replay() on σ's stream ─► fn's outputs (static tensors)
        memory_by_budget() / total_memory() ─► what the graphs hold on the device

`fn(batch_size)` reads static input tensors the caller owns (copy new inputs into them before
a replay) and returns its outputs; a replay rewrites those same output tensors.  Graph memory
scales with (#budgets x #batch sizes), as in SGLang's per-stream-group graph sets.

Caveats (shared/reference/gpu_and_engine_apis.md §1.8), none checked on hardware yet:
  * Replay keeps the partition: kernel nodes carry the context they were captured in
    (CUDA_KERNEL_NODE_PARAMS_v2.ctx), so a graph captured on σ's stream runs on σ's SMs
    wherever it is replayed.  Only a third-party report backs this; the SM-id check of
    `jigsaw.mux.partition.smid` must confirm it on a GPU.  Replay here always uses the capture stream.
  * One memory pool is shared by every graph, so two graphs must never run at once: a
    replay on another budget's stream first waits for the previous replay, and outputs of
    a replay are valid only until the next one.
  * Workqueue aliasing (pytorch#176582): eager work on other streams can delay a replay
    through shared hardware queues (CUDA_DEVICE_MAX_CONNECTIONS); the fix, workqueue-balanced
    green contexts (CUDA 13.1, workqueue_scope="balanced"), is not used here.
  * SGLang warns that green contexts with CUDA graphs may lose performance on torch 2.7-2.8.
  * Close BudgetGraphs before the GreenPartitions whose streams it captured on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Self

from jigsaw.mux.partition.green import Partition
from jigsaw.mux.partition.green_probe import require_torch_cuda
from jigsaw.mux.partition.smsplit import FRAC_TOL


class GraphNotCapturedError(LookupError):
    """replay() of a (budget, batch size) that was never captured."""


@dataclass(frozen=True, kw_only=True, slots=True)
class GraphMemory:
    """Device memory a capture added (deltas measured around torch.cuda.graph)."""

    pool_bytes: int = 0
    """Growth of torch's reserved memory: segments of the graphs' private pool."""
    live_bytes: int = 0
    """Growth of torch's allocated memory: tensors the graph keeps (its outputs)."""
    device_bytes: int = 0
    """Growth of device-wide used memory (cudaMemGetInfo): the pool plus what the driver
    allocates for the instantiated graph; other processes' allocations leak into it."""

    def __add__(self, other: GraphMemory) -> GraphMemory:
        return GraphMemory(pool_bytes=self.pool_bytes + other.pool_bytes,
                           live_bytes=self.live_bytes + other.live_bytes,
                           device_bytes=self.device_bytes + other.device_bytes)


class BudgetGraphs:
    """One CUDA-graph set per SM budget, each captured and replayed on that budget's stream.

    With a shared pool, later captures reuse the pool the first ones grew, so per-budget
    memory depends on capture order: the first budget captured carries most of the pool.
    """

    def __init__(self, partitions: Mapping[float, Partition], *, device: int = 0):
        self._torch = require_torch_cuda(device)  # GreenContextError says why there is no CUDA
        if not partitions:
            raise ValueError("BudgetGraphs needs at least one {budget: Partition}")
        self.device = device
        self._parts = dict(partitions)
        self._graphs: dict[tuple[float, int], tuple[Any, Any]] = {}
        self._memory: dict[tuple[float, int], GraphMemory] = {}
        self._pool: Any = None
        self._last_stream: Any = None

    @property
    def budgets(self) -> tuple[float, ...]:
        return tuple(self._parts)

    @property
    def captured(self) -> tuple[tuple[float, int], ...]:
        """(budget, batch size) keys that replay() accepts, in capture order."""
        return tuple(self._graphs)

    def capture(self, fn: Callable[[int], Any], batch_sizes: Iterable[int], *,
                budgets: Iterable[float] | None = None, warmup: int = 2) -> None:
        """Capture fn(batch size) for each budget (default: all) and batch size, largest first."""
        sizes = sorted(set(batch_sizes), reverse=True)
        for budget in (self.budgets if budgets is None else tuple(budgets)):
            key = self._budget(budget)
            for batch_size in sizes:
                self._capture_one(key, batch_size, fn, warmup)

    def _capture_one(self, budget: float, batch_size: int, fn: Callable[[int], Any], warmup: int) -> None:
        torch, stream = self._torch, self._parts[budget].stream
        if (budget, batch_size) in self._graphs:
            raise ValueError(f"budget {budget:g}, batch size {batch_size} is already captured")
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # lazy inits (cuBLAS workspaces) happen here, not in capture
            for _ in range(warmup):
                fn(batch_size)
        stream.synchronize()
        # NOTE: torch.cuda.graph() empties the cache on entry; do it first, or the warm-up's
        # cached blocks released there would be subtracted from the graph's pool.
        torch.cuda.empty_cache()
        before = self._usage()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream):
            outputs = fn(batch_size)
        stream.synchronize()
        after = self._usage()
        self._graphs[(budget, batch_size)] = (graph, outputs)
        self._memory[(budget, batch_size)] = GraphMemory(
            pool_bytes=after[0] - before[0], live_bytes=after[1] - before[1], device_bytes=after[2] - before[2])
        self._last_stream = stream

    def _usage(self) -> tuple[int, int, int]:
        cuda = self._torch.cuda
        free, total = cuda.mem_get_info(self.device)
        return cuda.memory_reserved(self.device), cuda.memory_allocated(self.device), total - free

    def replay(self, budget: float, batch_size: int, *, join: bool = True) -> Any:
        """Replay on the budget's stream, after the caller's current stream and the previous replay.

        join=True makes the caller's current stream wait for the replay, so its outputs can be
        read there; nothing blocks the host.
        """
        key = (self._budget(budget, replaying=True), batch_size)
        if key not in self._graphs:
            raise GraphNotCapturedError(f"no graph for budget {budget:g}, batch size {batch_size}; captured: "
                                        f"{', '.join(f'({b:g}, {n})' for b, n in self._graphs) or 'none'}")
        torch, stream = self._torch, self._parts[key[0]].stream
        graph, outputs = self._graphs[key]
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        if self._last_stream is not None and self._last_stream is not stream:
            stream.wait_stream(self._last_stream)  # shared pool: never two graphs at once
        with torch.cuda.stream(stream):
            graph.replay()
        self._last_stream = stream
        if join:
            current.wait_stream(stream)
        return outputs

    def memory_by_budget(self) -> dict[float, GraphMemory]:
        out = {budget: GraphMemory() for budget in self._parts}
        for (budget, _), mem in self._memory.items():
            out[budget] = out[budget] + mem
        return out

    def total_memory(self) -> GraphMemory:
        return sum(self._memory.values(), GraphMemory())

    def close(self) -> None:
        """Drop every graph and the pool (idempotent)."""
        graphs, self._graphs, self._memory = self._graphs, {}, {}
        for graph, _ in graphs.values():
            graph.reset()
        self._pool = self._last_stream = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _budget(self, budget: float, *, replaying: bool = False) -> float:
        for key in self._parts:
            if abs(key - budget) <= FRAC_TOL:
                return key
        if replaying:
            raise GraphNotCapturedError(f"no graphs for budget {budget!r}; budgets: {self.budgets}")
        raise ValueError(f"budget {budget!r} has no partition; budgets: {self.budgets}")
