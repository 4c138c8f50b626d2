"""In-process rollout engine of one DP worker, on transformers' continuous batching (CB).

    submit(Request) ──► mgr.add_request(prompt + partial, id "rid@n", streaming) ──► CB thread
                                                                                      │ one model
    forward pre/post hooks (CB thread) ──► ForwardStep(t, num_tokens) ──► forward_steps()   forward
                                                                                      │ per step
    mgr.get_result() ◄── streamed GenerationOutput (all tokens so far, every step) ◄──┘
        │ _drain(): keep the newest tokens + logprobs of each live request
        ├─ finished ──► Completion(finished=True) ──► poll()       (each exactly once)
        └─ abort(rid) ──► cancel_request + Completion(partial, finished=False)

Migration is recomputation: a request aborted here comes back elsewhere as
`Request(partial_ids=…, partial_logprobs=…)`; its prompt + partial is prefilled again and
only the remaining budget `max_new_tokens - len(partial_ids)` is generated.

Why streaming: CB drops a cancelled request silently (no output), so the partial output
of an abort is the last streamed state.  A token the CB thread produces between our last
drain and the cancellation is thrown away (the internal id "rid@n" is forgotten at once),
and regenerated wherever the request resumes, so greedy outputs stay token-identical.

The grant, applied here (mux/partition/bind.py, board.py):
    stream_source() before every forward (the CB thread) ──► bind.on_stream(stream): the forward
        runs on the grant's green side (None: the current stream; a fake GPU logs the launch)
    set_kv_limit(tokens) (the caller's thread; from the grant's memory, `kv_tokens_for`)
        ──► over the limit: the newest requests are preempted (aborted in CB, their tokens kept)
            and wait at the head of the queue; under it, the oldest waiting are admitted again
            (prompt + kept tokens prefilled: recomputation, as a migration is)

Only plain data crosses this module's API, so a DP worker process can ship it over a pipe;
torch / transformers are imported lazily so a worker can pin its threads before importing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from jigsaw.mux.partition.bind import follow_threads, on_stream


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """How one rollout engine generates and how big its paged KV cache is."""

    max_new_tokens: int = 64
    """Default response budget (a Request carries its own)."""
    temperature: float = 0.0
    """Sampling temperature; 0 = greedy (argmax)."""
    seed: int = 0
    """Seed of CB's sampler (irrelevant for greedy)."""
    page_size: int = 32
    """Tokens per KV page; small, since the CPU default (256) wastes memory on short rollouts."""
    num_blocks: int = 64
    """KV blocks; num_blocks * page_size tokens of KV in all (2048 by default).  Always set:
    CB's default sizes the cache from system RAM (GBs on CPU)."""
    max_batch_tokens: int = 256
    """Most query tokens (prefill tokens + decode requests) in one forward; longer prompts
    are prefilled in chunks."""
    threads: int | None = None
    """Intra-op threads of generation; None: one per core the worker may use, followed at
    every forward (a partition bound from outside changes them, mux/partition/bind.py)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    """One sample to generate, possibly resumed after a migration."""

    rid: str
    """Caller's id, unique among the requests in flight."""
    prompt_ids: tuple[int, ...]
    """Prompt tokens (never includes generated tokens)."""
    max_new_tokens: int
    """Total response budget of the sample, partial tokens included."""
    partial_ids: tuple[int, ...] = ()
    """Tokens generated elsewhere before a migration; generation continues after them."""
    partial_logprobs: tuple[float, ...] = ()
    """Logprobs of `partial_ids` as sampled; empty = recompute them here with the current
    weights (under a pause), which differs from the sampling policy after a weight update."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Completion:
    """Output of one request: finished, or the partial output of an abort."""

    rid: str
    """Caller's id."""
    prompt_ids: tuple[int, ...]
    """The original prompt (without partial tokens)."""
    output_ids: tuple[int, ...]
    """partial_ids + tokens generated here (EOS included when it stopped on EOS)."""
    logprobs: tuple[float, ...]
    """Logprob of each output token under the sampling distribution (after temperature);
    same length as output_ids; carried over for partial tokens."""
    finished: bool
    """True when it hit EOS or its budget; False for an abort."""
    prefilled_tokens: int = 0
    """Tokens this engine prefilled for it: its prompt, plus a migrated request's partial output."""
    generated_tokens: int = 0
    """Tokens this engine generated for it (output_ids minus what it was given)."""


@dataclass(frozen=True, slots=True)
class ForwardStep:
    """One model forward of the CB loop (times of the forward only, not of scheduling)."""

    t_start_s: float
    """Start, seconds on time.monotonic() (system-wide on Linux: comparable across processes)."""
    t_end_s: float
    """End, same clock."""
    num_tokens: int
    """Query tokens of the forward: prefill tokens + decoding requests."""
    num_prefill_tokens: int = 0
    """Tokens of sequences with more than one query token (prompt chunks)."""
    num_decode_reqs: int = 0
    """Sequences with exactly one query token (a one-token prompt counts here too)."""
    kv_tokens: int = 0
    """KV tokens those decoding sequences attend to (cache + the new token)."""


@dataclass(slots=True)
class _Live:
    """A request in this engine: waiting for KV room, or inside CB with its newest streamed state."""

    req: Request
    """As it goes into CB: a preempted request carries the tokens it had as partial_ids."""
    order: int
    """Arrival order: the newest are preempted first, the oldest admitted first."""
    partial_logprobs: tuple[float, ...]
    given: int = 0
    """Partial tokens the caller gave (a migrated request's), of req.partial_ids."""
    prefilled: int = 0
    """Tokens prefilled for it here so far (again after each preemption)."""
    cb_id: str = ""
    """Id inside CB, fresh per submission so stale outputs of an aborted run are recognisable;
    empty while it waits."""
    new_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)

    def tokens(self) -> int:
        """KV it holds, with the next token's."""
        return len(self.req.prompt_ids) + len(self.req.partial_ids) + len(self.new_ids) + 1

    def completion(self, finished: bool) -> Completion:
        output = self.req.partial_ids + tuple(self.new_ids)
        return Completion(rid=self.req.rid, prompt_ids=self.req.prompt_ids, output_ids=output,
                          logprobs=self.partial_logprobs + tuple(self.new_logprobs), finished=finished,
                          prefilled_tokens=self.prefilled, generated_tokens=len(output) - self.given)

    def kept(self) -> _Live:
        """Taken out of CB with its tokens: it resumes from prompt + everything generated."""
        req = dataclasses.replace(self.req, partial_ids=self.req.partial_ids + tuple(self.new_ids))
        return _Live(req=req, order=self.order, partial_logprobs=self.partial_logprobs + tuple(self.new_logprobs),
                     given=self.given, prefilled=self.prefilled)


class RolloutEngine:
    """Continuous-batching generation on one model; every method is for one caller thread."""

    def __init__(self, model, tokenizer, config: RolloutConfig = RolloutConfig(),
                 stream_source: Callable[[], Any] | None = None):
        """`stream_source`: the stream of the grant in force, asked before every forward (a
        board.Follower's `stream`); None: the current stream."""
        import torch

        self._torch = torch
        self.model, self.config = model, config
        self.eos_token_id = _eos_id(model, tokenizer)
        self._stream_source = stream_source
        self._launch: contextlib.AbstractContextManager | None = None
        self._live: dict[str, _Live] = {}
        """Inside CB, in admission order."""
        self._waiting: list[_Live] = []
        """Waiting for KV room, oldest first."""
        self._arrivals = itertools.count()
        self.kv_limit: int | None = None
        """KV tokens the engine may hold (None: CB's whole pool)."""
        self.preempted: list[tuple[str, int]] = []
        """(rid, tokens it kept) of every preemption, oldest first."""
        self._by_cb: dict[str, str] = {}
        self._done: list[Completion] = []
        self._steps: list[ForwardStep] = []
        self._steps_lock = threading.Lock()
        self._step_start: tuple[float, int, int] | None = None
        self.generation_num_threads: int | None = None
        """torch intra-op threads of the CB thread at its last forward (None before the first)."""
        self._recording = True
        self._serial = itertools.count()
        self._gate = threading.RLock()
        """Held by every forward of the CB thread: whoever holds it (a weight update, a logprob
        recomputation) runs between two forwards.  transformers < 5.11 has no manager pause."""
        self._hooks = [model.register_forward_pre_hook(self._on_pre, with_kwargs=True),
                       model.register_forward_hook(self._on_post, with_kwargs=True, always_call=True)]
        self._mgr = model.init_continuous_batching(generation_config=self._generation_config(tokenizer),
                                                   continuous_batching_config=self._cb_config())
        self._mgr.start()
        self._closed = False

    # ---------------------------------------------------------------- requests

    def submit(self, req: Request) -> None:
        """Queue a request; a resubmission prefills prompt + partial again (no KV is moved)."""
        if req.rid in self._live or any(w.req.rid == req.rid for w in self._waiting):
            raise ValueError(f"request {req.rid!r} is already in flight")
        if req.partial_logprobs and len(req.partial_logprobs) != len(req.partial_ids):
            raise ValueError(f"request {req.rid!r}: {len(req.partial_logprobs)} partial logprobs "
                             f"for {len(req.partial_ids)} partial tokens")
        logprobs = req.partial_logprobs or self._recompute_logprobs(req)
        live = _Live(req=req, order=next(self._arrivals), partial_logprobs=tuple(logprobs), given=len(req.partial_ids))
        remaining = req.max_new_tokens - len(req.partial_ids)
        if remaining <= 0 or (req.partial_ids and req.partial_ids[-1] == self.eos_token_id):
            self._done.append(live.completion(finished=True))  # nothing left to generate
            return
        self._waiting.append(live)
        self._admit()

    def abort(self, rid: str) -> Completion:
        """Take a request out: its partial output (finished=False), or its finished output
        (finished=True) when it finished but was not polled yet; poll() never returns it."""
        self._drain(0.0)
        for i, c in enumerate(self._done):
            if c.rid == rid:
                return self._done.pop(i)
        for i, w in enumerate(self._waiting):
            if w.req.rid == rid:
                return self._waiting.pop(i).completion(finished=False)
        live = self._live.pop(rid, None)
        if live is None:
            raise KeyError(f"request {rid!r} is not in this engine")
        self._cancel(live)
        return live.completion(finished=False)

    def abort_all(self) -> list[Completion]:
        """Abort every request in flight (finished-but-unpolled ones stay for poll())."""
        self._drain(0.0)
        waiting, self._waiting = self._waiting, []  # first: room freed below must not start them
        return [w.completion(finished=False) for w in waiting] + [self.abort(rid) for rid in list(self._live)]

    def active(self) -> list[str]:
        """Ids of the requests in flight (waiting for KV room or generating), oldest first."""
        return [x.req.rid for x in sorted((*self._live.values(), *self._waiting), key=lambda x: x.order)]

    def poll(self, timeout_s: float = 0.0) -> list[Completion]:
        """Finished requests since the last call; waits up to timeout_s for the first one."""
        deadline = time.monotonic() + timeout_s
        self._drain(0.0)
        while not self._done and self._live and time.monotonic() < deadline:
            self._drain(deadline - time.monotonic())
        done, self._done = self._done, []
        return done

    def holding(self) -> tuple[tuple[int, int], ...]:
        """(context tokens, tokens generated in its turn) of each request in flight, as last
        streamed (waiting ones too): what a migration of them, or the rest of a tail, is priced by."""
        return tuple((x.tokens() - 1, len(x.req.partial_ids) + len(x.new_ids))
                     for x in sorted((*self._live.values(), *self._waiting), key=lambda x: x.order))

    # ---------------------------------------------------------------- KV room

    def set_kv_limit(self, tokens: int | None) -> None:
        """Hold at most `tokens` of KV (None: CB's whole pool).  Over it, the newest requests
        are preempted with their tokens kept; under it, the oldest waiting ones start again.
        The oldest request always runs, so a limit below one request slows, never stops."""
        pool = self.config.num_blocks * self.config.page_size
        self.kv_limit = None if tokens is None else max(0, min(int(tokens), pool))
        self._drain(0.0)

    def kv_tokens_for(self, mem_bytes: int) -> int | None:
        """KV tokens a memory grant of `mem_bytes` holds beside the weights (None: not stated)."""
        if mem_bytes <= 0:
            return None
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return max(0, (mem_bytes - weights) // kv_bytes_per_token(self.model))

    def _used(self) -> int:
        page = self.config.page_size
        return sum(-(-x.tokens() // page) * page for x in self._live.values())

    def _fits(self, extra: int) -> bool:
        page = self.config.page_size
        return self.kv_limit is None or self._used() + -(-extra // page) * page <= self.kv_limit

    def _rebalance(self) -> None:
        self._shrink()
        self._admit()

    def _shrink(self) -> None:
        while self.kv_limit is not None and len(self._live) > 1 and not self._fits(0):
            newest = max(self._live.values(), key=lambda x: x.order)
            del self._live[newest.req.rid]
            self._cancel(newest)
            kept = newest.kept()
            self.preempted.append((kept.req.rid, len(kept.req.partial_ids)))
            self._waiting.append(kept)
            self._waiting.sort(key=lambda x: x.order)

    def _admit(self) -> None:
        while self._waiting and (not self._live or self._fits(self._waiting[0].tokens())):
            self._start(self._waiting.pop(0))

    def _start(self, live: _Live) -> None:
        req = live.req
        live.cb_id, live.new_ids, live.new_logprobs = f"{req.rid}@{next(self._serial)}", [], []
        live.prefilled += len(req.prompt_ids) + len(req.partial_ids)
        self._live[req.rid], self._by_cb[live.cb_id] = live, req.rid
        self._mgr.add_request(list(req.prompt_ids + req.partial_ids), request_id=live.cb_id,
                              max_new_tokens=req.max_new_tokens - len(req.partial_ids), streaming=True)

    def _cancel(self, live: _Live) -> None:
        del self._by_cb[live.cb_id]  # outputs still on their way are dropped as stale
        self._mgr.cancel_request(live.cb_id)

    def forward_steps(self) -> list[ForwardStep]:
        """Forward steps recorded since the last call, oldest first."""
        with self._steps_lock:
            steps, self._steps = self._steps, []
        return steps

    # ---------------------------------------------------------------- control

    def update_weights(self, state_dict) -> None:
        """Copy weights in place between two steps; in-flight requests keep their KV cache
        (computed with the old weights) and continue with the new ones."""
        unknown = sorted(set(state_dict) - set(self.model.state_dict()))
        if unknown:  # checked first: a rejected update must not be half applied
            raise ValueError(f"update_weights: unknown parameters {unknown[:5]}")
        with self._gate, self._torch.no_grad():
            self.model.load_state_dict(state_dict, strict=False)  # a subset is fine (tied lm_head)

    def close(self) -> None:
        """Stop the CB thread (in-flight requests are dropped) and remove the hooks."""
        if self._closed:
            return
        self._closed = True
        try:
            self._mgr.stop(block=True, hard_stop=True)
            self._mgr.destroy()
        finally:
            for h in self._hooks:
                h.remove()

    def __enter__(self) -> RolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _generation_config(self, tokenizer):
        from transformers import GenerationConfig

        greedy = self.config.temperature <= 0
        pad = getattr(tokenizer, "pad_token_id", None)
        return GenerationConfig(do_sample=not greedy, temperature=None if greedy else self.config.temperature,
                                max_new_tokens=self.config.max_new_tokens, eos_token_id=self.eos_token_id,
                                pad_token_id=self.eos_token_id if pad is None else pad)

    def _cb_config(self):
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        c = self.config
        known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
        # transformers < 5.11 (verl 0.9.1's pin) calls the page `block_size` and never switches
        # attention to flash by itself
        page = {"page_size": c.page_size} if "page_size" in known else {"block_size": c.page_size}
        flash = {"auto_switch_to_flash": False} if "auto_switch_to_flash" in known else {}
        return ContinuousBatchingConfig(**page, **flash, num_blocks=c.num_blocks, max_batch_tokens=c.max_batch_tokens,
                                        return_logprobs=True, use_cuda_graph=False, seed=c.seed)

    def _drain(self, timeout_s: float) -> None:
        """Take every output CB has delivered; block up to timeout_s for the first one."""
        if not self._mgr.is_running() and self._live:
            raise RuntimeError(f"continuous batching loop stopped with {len(self._live)} requests in flight")
        out = self._mgr.get_result(timeout=max(timeout_s, 0.0))  # timeout 0: does not block
        while out is not None:
            self._accept(out)
            out = self._mgr.get_result(timeout=0.0)
        self._rebalance()

    def _accept(self, out) -> None:
        rid = self._by_cb.get(out.request_id)
        if rid is None:  # a stale output of an aborted submission
            if not out.is_finished():
                # CB drains cancellations and new requests in one go; a cancel that overtook its
                # add_request is a no-op there, so cancel again or it runs on as a zombie
                self._mgr.cancel_request(out.request_id)
            return
        live = self._live[rid]
        if out.error is not None:
            raise RuntimeError(f"request {rid!r} failed in continuous batching: {out.error}")
        live.new_ids, live.new_logprobs = list(out.generated_tokens), list(out.logprobs)
        if out.is_finished():
            del self._live[rid], self._by_cb[out.request_id]
            self._done.append(live.completion(finished=True))

    def _recompute_logprobs(self, req: Request) -> list[float]:
        """Logprobs of the partial tokens under the current weights, the CB loop paused."""
        if not req.partial_ids:
            return []
        torch = self._torch
        ids = torch.tensor([req.prompt_ids + req.partial_ids], device=self.model.device)
        with self._gate, torch.no_grad():
            self._recording = False  # this forward is not a CB step
            try:
                logits = self.model(input_ids=ids).logits[0, len(req.prompt_ids) - 1:-1].float()
            finally:
                self._recording = True
        if self.config.temperature > 0:
            logits = logits / self.config.temperature
        tokens = torch.tensor(req.partial_ids, device=logits.device)
        picked = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])
        return picked[:, 0].tolist()

    def _on_pre(self, module, args, kwargs) -> None:
        self._gate.acquire()  # released by _on_post, which runs even when the forward raises
        if not self._recording:
            return
        if self._stream_source is not None:  # the grant in force now: a budget change lands here
            self._launch = on_stream(self._stream_source(), kv_tokens=self.kv_limit)
            self._launch.__enter__()
        # the CB thread's OpenMP setting is its own: it follows the cores it may use now
        self.generation_num_threads = follow_threads(self.config.threads)
        self._step_start = (time.monotonic(), *_split_query(kwargs))

    def _on_post(self, module, args, kwargs, output) -> None:
        try:
            launch, self._launch = self._launch, None
            if launch is not None:
                launch.__exit__(None, None, None)
            self._record()
        finally:
            self._gate.release()

    def _record(self) -> None:
        if not self._recording or self._step_start is None:
            return
        t0, prefill, decode, kv = self._step_start
        self._step_start = None
        step = ForwardStep(t0, time.monotonic(), prefill + decode, prefill, decode, kv)
        with self._steps_lock:
            self._steps.append(step)


def _split_query(kwargs) -> tuple[int, int, int]:
    """(prefill tokens, decode requests, their KV tokens) of a packed CB forward, from
    cu_seq_lens_q and cu_seq_lens_k (transformers >= 5.11 keys the latter by layer type)."""
    cu = kwargs.get("cu_seq_lens_q")
    ids = kwargs.get("input_ids")
    if cu is None:  # not a CB forward: count everything as prefill
        return (0 if ids is None else int(ids.shape[-1])), 0, 0
    lens = (cu[1:] - cu[:-1]).tolist()
    cu_k = kwargs.get("cu_seq_lens_k")
    if isinstance(cu_k, dict):
        cu_k = next(iter(cu_k.values()), None)
    kv = (cu_k[1:] - cu_k[:-1]).tolist() if cu_k is not None and len(cu_k) == len(cu) else [0] * len(lens)
    decode = [i for i, n in enumerate(lens) if n == 1]
    return sum(n for n in lens if n > 1), len(decode), sum(kv[i] for i in decode)


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V one token takes in every layer of `model` (a transformers causal LM)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    dtype_bytes = next(model.parameters()).element_size()
    return 2 * c.num_hidden_layers * heads * head_dim * dtype_bytes


def _eos_id(model, tokenizer) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = model.generation_config.eos_token_id
    if isinstance(eos, list):
        eos = eos[0]
    return -1 if eos is None else int(eos)


__all__ = ["Completion", "ForwardStep", "Request", "RolloutConfig", "RolloutEngine"]
