"""One verl rollout replica served by jigsaw's continuous-batching engine, on the host CPU.

    verl agent-loop worker ── server.generate.remote(prompt_ids, sampling_params, request_id)
        │ (async Ray actor: many requests in flight)
        ▼
    RolloutServer.generate ──► inbox ──► engine thread (owns the RolloutEngine)
                                            │ first request of a rollout: client.rollout(...).start()
                                            │   waits for the daemon's admission (fails open)
                                            │ engine.forward_steps() ──► Rollout.forward(): regime
                                            │   sub-stages (prefill / decode / tail) of this replica
                                            │ engine.poll() ──► Completion ──► the request's future
                                            └ nothing in flight ──► Rollout.close(): rollout over
    TokenOutput(token_ids, log_probs, stop_reason="completed" | "abort", extra_fields)

An aborted request (`abort_all_requests`, a migration) returns its partial output with
`stop_reason="abort"`, the form verl's resuming client (`FullyAsyncLLMServerClient`) continues
from.  Weights arrive from the trainer's leader rank through Ray's object store
(`update_weights`, verl's "naive" sync) and are copied in place between forwards.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from dataclasses import dataclass

from jigsaw.integrations.verl.serving import Moved

log = logging.getLogger("jigsaw.verl")

ABORT = "abort"
"""verl's stop reason of an aborted request (`FullyAsyncLLMServerClient` resumes it)."""
POLL_S = 0.01


def server_name(replica_rank: int, suffix: str = "") -> str:
    """The Ray actor name of replica `replica_rank`'s server (rollout.py launches it; a
    migration finds its target by it)."""
    return f"jigsaw_rollout_{replica_rank}{suffix}"


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerConfig:
    """What one replica generates with, from verl's rollout config."""

    model_path: str = ""
    """HF checkpoint directory (verl's `model_config.local_path`); JigsawReplica sets it."""
    temperature: float = 1.0
    """Sampling temperature of every request (0: greedy); a request asking another is refused."""
    max_new_tokens: int = 512
    """Default budget (verl's `response_length`); a request's `max_new_tokens` wins."""
    seed: int = 0
    """Sampler seed."""
    replica_rank: int = 0
    """verl's replica rank; the daemon's DP rank is this modulo its devices (placement.py)."""
    threads: int | None = None
    """Intra-op threads of generation (None: the cores it may use)."""


@dataclass(slots=True)
class _Pending:
    rid: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop
    partial_ids: tuple[int, ...] = ()
    partial_logprobs: tuple[float, ...] = ()


class RolloutServer:
    """The Ray actor of one replica (constructed by `JigsawReplica.launch_servers`)."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.global_steps: int | None = None
        self.jigsaw_step = 0
        self._inbox: queue.Queue = queue.Queue()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._serving = None
        self._router = None
        self._thread = threading.Thread(target=self._run, name="jigsaw-rollout", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ verl's calls

    async def ready(self) -> bool:
        await asyncio.to_thread(self._ready.wait)
        if self._error is not None:
            raise RuntimeError(f"jigsaw rollout replica {self.config.replica_rank} failed to start: {self._error}")
        return True

    def get_server_address(self) -> tuple[str, int]:
        return f"jigsaw-rollout-{self.config.replica_rank}", 0

    async def generate(self, prompt_ids, sampling_params: dict, request_id: str, image_data=None, video_data=None,
                       **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        if image_data or video_data:
            raise ValueError("the jigsaw CPU rollout serves text only (image_data / video_data given)")
        budget = self._budget(dict(sampling_params))
        ids = tuple(int(t) for t in (prompt_ids.tolist() if hasattr(prompt_ids, "tolist") else prompt_ids))
        c = await self.resume(str(request_id), ids, budget)
        while isinstance(c, Moved):  # handed over mid-generation: it goes on where it was sent
            c = await self._elsewhere(c, str(request_id), ids, budget)
        return TokenOutput(token_ids=list(c.output_ids), log_probs=list(c.logprobs),
                           stop_reason="completed" if c.finished else ABORT,
                           extra_fields={"global_steps": self.global_steps})

    async def resume(self, request_id: str, prompt_ids: tuple[int, ...], max_new_tokens: int,
                     partial_ids: tuple[int, ...] = (), partial_logprobs: tuple[float, ...] = ()):
        """Generate here, continuing after `partial_ids` (a migrated request): its Completion,
        or Moved if this replica hands it on in turn."""
        loop = asyncio.get_running_loop()
        p = _Pending(rid=request_id, prompt_ids=tuple(prompt_ids), max_new_tokens=int(max_new_tokens),
                     done=loop.create_future(), loop=loop, partial_ids=tuple(partial_ids),
                     partial_logprobs=tuple(partial_logprobs))
        self._inbox.put(("generate", p))
        return await p.done

    async def _elsewhere(self, moved, rid: str, ids: tuple[int, ...], budget: int):
        import ray

        c = moved.completion
        try:
            target = ray.get_actor(server_name(moved.target_replica))
        except ValueError:  # no such replica: it goes on here
            log.warning("jigsaw: no rollout replica %d to move %s to; it goes on here", moved.target_replica, rid)
            return await self.resume(rid, ids, budget, c.output_ids, c.logprobs)
        return await target.resume.remote(rid, ids, budget, c.output_ids, c.logprobs)

    async def migrate_to(self, replica_rank: int) -> int:
        """Hand every request in flight to replica `replica_rank` (what a daemon's migration
        order does): how many moved."""
        return await self._call("migrate", replica_rank)

    async def migration_stats(self) -> dict:
        s = self._serving.stats if self._serving is not None else None
        return {"forwards": s.forwards if s else 0, "moved_out": s.moved_out if s else 0,
                "resumed": list(s.resumed) if s else []}

    async def update_weights(self, state: dict) -> None:
        await self._call("update_weights", state)

    async def abort_all_requests(self, reject_request: bool = False) -> int:
        return await self._call("abort_all", None)

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    async def set_router(self, router) -> None:
        """verl's balancer (balancer.JigsawBalancer), told the plan's routing weights."""
        self._router = router

    def _tell_router(self, weights: tuple[float, ...]) -> None:
        if self._router is not None:
            self._router.set_routing.remote(list(weights))  # fire and forget: a bias, not a contract

    async def set_jigsaw_step(self, step: int) -> None:
        """The trainer's step the next rollout belongs to (the daemon's step number)."""
        self.jigsaw_step = int(step)

    async def pids(self) -> list[int]:
        return [os.getpid()]

    # host memory is never released on a CPU: these are verl's GPU memory controls
    async def wake_up(self):
        return None

    async def sleep(self):
        return None

    async def resume_generation(self):
        return None

    async def clear_kv_cache(self):
        return None

    async def release_kv_cache(self):
        return None

    async def resume_kv_cache(self):
        return None

    async def start_profile(self, **kwargs):
        return None

    async def stop_profile(self):
        return None

    # ------------------------------------------------------------ the engine thread

    def _budget(self, params: dict) -> int:
        temperature = float(params.get("temperature", self.config.temperature))
        if abs(temperature - self.config.temperature) > 1e-9:
            raise ValueError(f"the jigsaw CPU rollout samples at temperature {self.config.temperature} "
                             f"(rollout.temperature); a request asked {temperature}")
        if float(params.get("top_p", 1.0)) < 1.0 or int(params.get("top_k", -1)) > 0:
            raise ValueError("the jigsaw CPU rollout samples the full distribution: top_p must be 1 and top_k -1")
        budget = params.get("max_new_tokens", params.get("max_tokens", self.config.max_new_tokens))
        return int(budget)

    async def _call(self, what: str, arg):
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._inbox.put((what, (arg, fut, loop)))
        return await fut

    def _run(self) -> None:
        try:
            engine = self._engine()
        except BaseException as exc:  # noqa: BLE001 - said by ready(), which verl awaits
            self._error = exc
            self._ready.set()
            return
        from jigsaw.integrations.verl.serving import Serving

        self._serving = Serving(engine, self.config, lambda: self.jigsaw_step, on_routing=self._tell_router)
        self._ready.set()
        self._serving.serve(self._inbox)

    def _engine(self):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from jigsaw.engines.rollout import RolloutConfig, RolloutEngine

        c = self.config
        model = AutoModelForCausalLM.from_pretrained(c.model_path, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(c.model_path)
        rc = RolloutConfig(max_new_tokens=c.max_new_tokens, temperature=c.temperature, seed=c.seed, threads=c.threads)
        return RolloutEngine(model, tok, rc)
