"""The KV pool of a simulated rollout engine, bounded like a real engine's.

What SGLang's scheduler and vLLM's recompute preemption do, per RolloutWorker:
    capacity = (granted memory − weights − reserve) / KV bytes per token
    admission  a queued request is prefilled only if its context, plus a reserve for what the
               running requests may still generate (SGLang's new_token_ratio), fits; else it
               waits (head of line, first come first served)
    tool waits their KV stays cached (radix cache) but is evicted first when room is needed,
               then the cached prefixes of queued requests (last queued first); they prefill
               their whole context again when admitted
    decode     a segment ends where the pool is full; then requests are retracted (SGLang
               `retract_decode`: fewest generated tokens first) until the rest can run
               RETRACT_DECODE_STEPS more steps; a retracted request keeps what it generated
               and recomputes its whole context when re-admitted
A pool that cannot hold one whole response raises DoesNotFit: no engine could run it.
"""

from __future__ import annotations

import numpy as np

from jigsaw.sim.request import Request

NEW_TOKEN_RATIO = 0.1
"""Share of its remaining generation budget a running request is expected to still use,
reserved at admission: SGLang's floor (it starts at 0.7 and decays to 0.1 within a few
hundred decode steps while nothing is retracted; a rollout runs thousands)."""
CLIP_MAX_NEW_TOKENS = 4096
"""SGLang caps the per-request reserve at this many tokens (CLIP_MAX_NEW_TOKENS)."""
RETRACT_DECODE_STEPS = 20
"""After a retraction the batch must fit this many more steps (SGLang retract_decode_steps)."""


class DoesNotFit(ValueError):
    """The rollout's KV pool cannot hold one whole response: the deployment cannot run."""


class KVPool:
    """Admission, eviction and retraction over a RolloutWorker's request lists (the engine
    keeps them; this mixin only decides what fits).  Needs: queue, decoding, in_tool,
    barrier, cost, mem_bytes, max_new_tokens, device_tokens, cap_tokens, chunk, retracted."""

    def tokens_in(self, mem_bytes: float) -> int:
        """KV tokens that fit beside the weights and the reserve in `mem_bytes`."""
        c = self.cost
        return max(0, int((mem_bytes - c.weights_bytes() - c.config.rollout_reserve_bytes) // c.kv_bytes_per_token()))

    def grant(self, mem_bytes: float) -> bool:
        """The plan's memory budget bounds the pool; whether the capacity changed."""
        floor = self.floor_tokens()
        cap = min(self.device_tokens, self.tokens_in(mem_bytes))
        self.undersized = cap < floor
        cap = max(cap, floor)
        changed, self.cap_tokens = cap != self.cap_tokens, cap
        return changed

    def _locked(self) -> int:
        return sum(r.context - r.pending for r in [*self.queue, *self.decoding])

    def _cached(self) -> int:
        return sum(r.context - r.pending for r in [*self.in_tool, *self.barrier])

    def _reserve(self) -> float:
        return NEW_TOKEN_RATIO * sum(min(self.max_new_tokens - r.output_tokens, CLIP_MAX_NEW_TOKENS)
                                     for r in self.decoding)

    def _admit(self) -> list[tuple[Request, int]]:
        """The next prefill chunk: queued requests in order while their KV fits (module docstring)."""
        free = self.cap_tokens - self._locked() - self._cached() - self._reserve()
        budget, batch = self.chunk, []
        for r in self.queue:
            if budget <= 0:
                break
            n = min(r.pending, budget)
            started = r.pending < r.context and r.turn == 0 and r.generated == 0
            need = n if started else r.pending + NEW_TOKEN_RATIO * min(
                self.max_new_tokens - r.output_tokens, CLIP_MAX_NEW_TOKENS)
            if need > free:
                free += self._evict(need - free, keep={id(q) for q, _ in batch} | {id(r)})
            if need > free and (batch or self.decoding or self._locked()):
                break  # head of line waits for decoding requests to free their KV
            batch.append((r, n))
            budget, free = budget - n, free - need
        return batch

    def _evict(self, tokens: float, keep: set[int] = frozenset()) -> int:
        """Drop cached KV of requests not running: those waiting on tools, then queued ones
        (last queued first) but those in `keep`; they recompute it when admitted.  A queued
        request's cached prefix is an unlocked radix-cache entry in SGLang: evictable until
        it is scheduled.  Keeping it locked let a pool full of queued prefixes starve the
        head of the queue with nothing decoding."""
        freed = 0
        queued = [r for r in reversed(self.queue) if id(r) not in keep]
        for r in [*self.in_tool, *self.barrier, *queued]:
            if freed >= tokens:
                break
            held = r.context - r.pending
            if held > 0:
                r.pending, freed = r.context, freed + held
                self.retracted += 1
        return freed

    def _room_for(self, batch: int) -> int:
        """KV tokens free for decoding `batch` requests, after evicting and retracting if needed."""
        room = self.cap_tokens - self._locked() - self._cached()
        if room < batch:
            room += self._evict(batch - room)
        if room < batch:
            self._retract()
            room = self.cap_tokens - self._locked() - self._cached()
        return room

    def _retract(self) -> None:
        """SGLang's retract_decode: partial prefills, then the fewest generated tokens first,
        until the rest can decode RETRACT_DECODE_STEPS more steps (one always stays)."""
        victims = [r for r in self.queue if r.pending < r.context]
        victims += sorted(self.decoding, key=lambda r: (r.output_tokens, -r.context))
        for r in victims:
            if len(self.decoding) <= 1 and r in self.decoding:
                break
            if self.cap_tokens - self._locked() - self._cached() >= RETRACT_DECODE_STEPS * len(self.decoding):
                break
            if r in self.decoding:
                self.decoding.remove(r)
            else:
                self.queue.remove(r)
            r.pending = r.context
            self.queue.appendleft(r)  # the oldest requests come back first
            self.retracted += 1

    def need_bytes(self, kv_tokens) -> np.ndarray:
        """Memory the engine needs to hold `kv_tokens` of KV cache: weights, that KV and the
        reserve, at most its pool (what a memory budget must leave it; less KV is a smaller
        batch, which the slowdown grid's memory axis prices), and never less than room for the
        largest response it runs to finish (`floor_tokens`)."""
        c = self.cost
        floor = self.floor_tokens()
        weights, per_token, reserve = c.weights_bytes(), c.kv_bytes_per_token(), c.config.rollout_reserve_bytes
        kv = np.maximum(np.asarray(kv_tokens, dtype=float), floor) * per_token
        need = weights + kv + reserve
        top = max(self.mem_bytes, weights + floor * per_token + reserve)
        return np.minimum(need, top).astype(np.int64)

    def floor_tokens(self) -> int:
        """KV the largest running request may still need to finish: its context, what the cap
        lets it generate, the tool output still to come (SGLang fails a request that cannot
        fit alone; retraction makes room for everything else)."""
        cap, most = self.max_new_tokens, 0
        for r in self._active():  # at every step: a plain loop over the requests' running sums
            need = r.context + r.to_append + max(0, cap - r.done_tokens - r.generated)
            if need > most:
                most = need
        return min(self.device_tokens, most)

    def held_kv_tokens(self) -> int:
        """KV the engine holds now: every request it has started, waiting on a tool or not."""
        return int(sum(r.context - r.pending for r in [*self.queue, *self.decoding, *self.in_tool, *self.barrier]))

