"""Data-parallel rollout: one worker process per DP rank, each with its own RolloutEngine.

    DPRollout (caller process)                          worker r (procs.py; builds the model itself)
      generate(prompts, routing) ── split by weights ──► "submit" [Request…] ──► RolloutEngine
        loop every poll_interval_s, until every sample is back or timeout_s:         │ CB thread
          "poll" ◄── (finished Completions, ForwardSteps, requests held) ◄────────────┘
             ├─ on_step(rank, step) for every forward step   (the recipe feeds jigsaw's client)
             ├─ held[rank]: (context, generated) tokens of each request in flight there
             └─ on_poll(self)  ──► migrate(source, target):
                   "abort_all" on source ─► partials ─► "submit" Request(partial_ids=…) on target
      update_weights(state_dict) ── torch.save bytes ──► "update_weights" on every worker (paused CB)
      reload(state_dict), from on_poll: "abort_all" everywhere ─► update_weights ─► each worker's
               partials "submit"ted back to it (fully async: resumed under the new weights)
      pids, num_params (each worker's hello)
      pids ──► whoever binds the workers to a partition (the client, mux/partition/bind.py); a worker's
               generation threads follow the cores it may use
      board ──► each worker follows the grant its client posts for its pid (mux/partition/board.py):
               every forward on the grant's stream, the KV room from its memory before every command

Commands are (name, args) tuples of plain data over one Pipe per worker, answered in order,
so a worker never runs two commands at once: a request is either returned by "poll" or by
"abort_all", never both, and `migrate` cannot lose or duplicate a sample.  Workers exit
on "close", when the pipe breaks (caller gone), and are terminated by `close()` otherwise.
"""

from __future__ import annotations

import io
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Pipe
from pathlib import Path

from jigsaw.engines import procs
from jigsaw.engines.rollout import Completion, ForwardStep, Request, RolloutConfig


@dataclass(slots=True)
class _Pending:
    """A sample of the running generate(): where it is and what it asked for."""

    rank: int
    request: Request


class WorkerError(RuntimeError):
    """A rollout worker failed a command, died or stopped answering."""


class DPRollout:
    """Rollout workers as processes; every method is for one caller thread."""

    def __init__(self, model_config=None, config: RolloutConfig = RolloutConfig(), num_workers: int = 2,
                 *, poll_interval_s: float = 0.005, rpc_timeout_s: float = 120.0, board: Path | None = None):
        """`board`: where the pipeline's client posts each worker's grant (Client.board); the
        workers follow their postings (green side, KV room).  None: no daemon, nothing to follow."""
        if num_workers < 1:
            raise ValueError("num_workers must be >= 1")
        self.config, self.num_workers, self.board = config, num_workers, board
        self.poll_interval_s, self.rpc_timeout_s = poll_interval_s, rpc_timeout_s
        self.migrated = 0
        """Requests moved by migrate() so far."""
        self.resumed = 0
        """Requests stopped by reload() and resumed under new weights, so far."""
        self.finished_on: dict[str, int] = {}
        """Rank each sample of the last generate() finished on (after any migration)."""
        self.moves: list[tuple[str, int, int, int]] = []
        """(rid, source, target, partial tokens it carried) of every request migrate() moved."""
        self._pending: dict[str, _Pending] = {}
        self._results: dict[str, Completion] = {}
        self._procs, self._conns = [], []
        self.pids: list[int] = []
        """Worker process ids, by rank."""
        self.num_params = 0
        """Parameters of the model the workers serve (for FLOPs: the caller need not load it)."""
        self.held: list[tuple[tuple[int, int], ...]] = [() for _ in range(num_workers)]
        """Per rank, (context tokens, tokens generated) of each request in flight at its last poll."""
        try:
            self._spawn(model_config)
        except BaseException:
            self.close()
            raise

    def _spawn(self, model_config) -> None:
        for rank in range(self.num_workers):  # start all before waiting: they load in parallel
            parent, child = Pipe()
            proc = procs.process(_worker_main, (child, model_config, self.config, self.board),
                                 name=f"jigsaw-rollout-{rank}")
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        hellos = [self._recv(rank) for rank in range(self.num_workers)]
        self.pids, self.num_params = [pid for pid, _ in hellos], hellos[0][1]

    # ---------------------------------------------------------------- generation

    def generate(self, prompts: list[tuple[str, tuple[int, ...]]], max_new_tokens: int | list[int],
                 routing: Sequence[float] | None = None,
                 on_step: Callable[[int, ForwardStep], None] | None = None,
                 on_poll: Callable[[DPRollout], None] | None = None, timeout_s: float = 600.0) -> list[Completion]:
        """Generate every prompt, split across workers by `routing` weights; blocks until all
        finished (WorkerError after `timeout_s`) and returns one Completion per prompt, in
        input order."""
        if self._pending:
            raise RuntimeError("generate() is already running")
        requests = _requests(prompts, max_new_tokens)
        self.finished_on = {}
        routing = [1.0] * self.num_workers if routing is None else list(routing)
        if len(routing) != self.num_workers:
            raise ValueError(f"{len(routing)} routing weights for {self.num_workers} workers")
        ranks = split_by_weights(len(requests), routing)
        try:
            for rank in range(self.num_workers):
                batch = [r for r, k in zip(requests, ranks) if k == rank]
                self._pending.update({r.rid: _Pending(rank, r) for r in batch})
                if batch:
                    self._rpc(rank, "submit", batch)
            deadline = time.monotonic() + timeout_s
            while self._pending:
                if time.monotonic() > deadline:
                    raise WorkerError(f"generate() did not finish in {timeout_s:g} s: {len(self._pending)} samples "
                                      f"outstanding ({sorted(self._pending)[:4]} ...)")
                time.sleep(self.poll_interval_s)  # always: a spinning caller would steal the workers' cores
                self._poll_round(on_step)
                if on_poll is not None:
                    on_poll(self)
            return [self._results[r.rid] for r in requests]
        except BaseException:
            self._reset_workers()
            raise
        finally:
            self._pending.clear()
            self._results = {}

    def _poll_round(self, on_step) -> None:
        """Collect finished samples and forward steps of every worker."""
        for rank in range(self.num_workers):
            done, steps, self.held[rank] = self._rpc(rank, "poll")
            if on_step is not None:
                for step in steps:
                    on_step(rank, step)
            for c in done:
                self._finish(c)

    def _finish(self, c: Completion) -> None:
        entry = self._pending.pop(c.rid, None)
        if entry is None:
            raise WorkerError(f"completion for {c.rid!r}, which is not pending (lost or duplicated)")
        self._results[c.rid], self.finished_on[c.rid] = c, entry.rank

    def pending(self) -> dict[str, int]:
        """Samples of the running generate() not finished yet: rid → worker rank."""
        return {rid: p.rank for rid, p in self._pending.items()}

    def migrate(self, source: int, target: int) -> int:
        """Move every request in flight on `source` to `target` (prompt + partial output,
        remaining budget; the KV cache is recomputed there).  Returns how many moved;
        those that finished during the move are kept as finished."""
        if source == target:
            return 0
        moved = self._abort(source)
        for req in moved:
            self.moves.append((req.rid, source, target, len(req.partial_ids)))
            self._pending[req.rid].rank = target
        if moved:
            self._rpc(target, "submit", moved)
        self.migrated += len(moved)
        return len(moved)

    def reload(self, state_dict) -> int:
        """New weights in the middle of generate() (fully asynchronous RL, AReaL's
        interruptible rollout): every request in flight stops, the weights load, and each
        request goes on where it was with what it generated (its KV recomputed under the new
        weights).  Returns how many resumed; one that finished meanwhile is kept as finished."""
        stopped = {rank: self._abort(rank) for rank in range(self.num_workers)}
        self.update_weights(state_dict)
        for rank, reqs in stopped.items():
            if reqs:
                self._rpc(rank, "submit", reqs)
        resumed = sum(len(reqs) for reqs in stopped.values())
        self.resumed += resumed
        return resumed

    def _abort(self, rank: int) -> list[Request]:
        """Stop every request in flight on `rank`: each as a Request carrying its partial output
        (those that finished before the abort reached them are finished here)."""
        out = []
        for c in self._rpc(rank, "abort_all"):
            if c.finished:  # finished after our last poll, before the abort reached it
                self._finish(c)
                continue
            entry = self._pending.get(c.rid)
            if entry is None:
                raise WorkerError(f"worker {rank} aborted {c.rid!r}, which is not pending")
            req = entry.request
            out.append(Request(rid=req.rid, prompt_ids=req.prompt_ids, max_new_tokens=req.max_new_tokens,
                               partial_ids=c.output_ids, partial_logprobs=c.logprobs))
        return out

    # ---------------------------------------------------------------- control

    def status(self, rank: int) -> dict:
        """pid, affinity (per thread too), torch threads and requests in flight of a worker."""
        return self._rpc(rank, "status")

    def update_weights(self, state_dict) -> None:
        """Copy `state_dict` into every worker's model in place (between two CB steps)."""
        import torch

        buf = io.BytesIO()
        torch.save({k: v.detach().cpu().contiguous() for k, v in state_dict.items()}, buf)
        blob = buf.getvalue()
        for rank in range(self.num_workers):  # all workers load at once, then answer
            self._send(rank, "update_weights", blob)
        errors = []
        for rank in range(self.num_workers):  # read every answer, or a pipe falls out of step
            try:
                self._recv(rank)
            except WorkerError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Stop every worker: ask, then terminate, then kill; safe to call twice."""
        for proc, conn in zip(self._procs, self._conns):
            try:
                if proc.is_alive():
                    conn.send(("close", ()))
            except (OSError, ValueError):
                pass  # pipe already broken: terminate below
        for proc in self._procs:
            _stop(proc)
        for conn in self._conns:
            conn.close()
        self._procs, self._conns = [], []

    def __enter__(self) -> DPRollout:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- transport

    def _reset_workers(self) -> None:
        """After a failed generate(): drop whatever the workers still hold (best effort)."""
        for rank in range(len(self._conns)):
            try:
                self._rpc(rank, "reset")
            except Exception:  # the original error matters more
                pass

    def _rpc(self, rank: int, name: str, *args):
        self._send(rank, name, *args)
        return self._recv(rank)

    def _send(self, rank: int, name: str, *args) -> None:
        try:
            self._conns[rank].send((name, args))
        except (OSError, ValueError) as e:
            raise WorkerError(f"rollout worker {rank} is gone ({self._exit(rank)})") from e

    def _recv(self, rank: int):
        conn = self._conns[rank]
        try:
            if not conn.poll(self.rpc_timeout_s):
                self._procs[rank].kill()  # a late answer would put its pipe out of step
                raise WorkerError(f"rollout worker {rank} did not answer in {self.rpc_timeout_s} s; killed")
            status, value = conn.recv()
        except (EOFError, OSError) as e:
            raise WorkerError(f"rollout worker {rank} died ({self._exit(rank)})") from e
        if status == "err":
            raise WorkerError(f"rollout worker {rank}: {value}")
        return value

    def _exit(self, rank: int) -> str:
        proc = self._procs[rank]
        proc.join(timeout=1.0)
        return f"exit code {proc.exitcode}"


def split_by_weights(n: int, weights: Sequence[float]) -> list[int]:
    """Rank of each of n samples: contiguous runs (a GRPO group stays together) sized by
    largest remainders of n·w/Σw; ties go to the lower rank."""
    w = [max(0.0, float(x)) for x in weights]
    total = sum(w)
    if not w or total <= 0:
        raise ValueError(f"routing weights must have a positive sum, got {list(weights)}")
    exact = [n * x / total for x in w]
    counts = [math.floor(e) for e in exact]
    by_remainder = sorted(range(len(w)), key=lambda r: (-(exact[r] - counts[r]), r))
    for r in by_remainder[:n - sum(counts)]:
        counts[r] += 1
    return [rank for rank, c in enumerate(counts) for _ in range(c)]


def _requests(prompts, max_new_tokens) -> list[Request]:
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(prompts):
        raise ValueError(f"{len(budgets)} budgets for {len(prompts)} prompts")
    rids = [rid for rid, _ in prompts]
    if len(set(rids)) != len(rids):
        raise ValueError("prompt ids must be unique")
    return [Request(rid=rid, prompt_ids=tuple(ids), max_new_tokens=b) for (rid, ids), b in zip(prompts, budgets)]


def _stop(proc, grace_s: float = 5.0) -> None:
    proc.join(timeout=grace_s)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=2.0)
    if proc.is_alive():
        proc.kill()
        proc.join()


# -------------------------------------------------------------------- worker process


def _worker_main(conn, model_config, config: RolloutConfig, board: Path | None = None) -> None:
    """Entry point of a worker: load, announce the pid, serve commands until close/EOF."""
    code = 0
    try:
        from jigsaw.engines.model import ModelConfig, load
        from jigsaw.engines.rollout import RolloutEngine
        from jigsaw.mux.partition.bind import follow_threads
        from jigsaw.mux.partition.board import Follower

        follow_threads(config.threads)  # before the CB thread exists: it starts from this
        model, tokenizer = load(model_config or ModelConfig())
        follower = Follower(board)
        engine = RolloutEngine(model, tokenizer, config, stream_source=follower.stream if board else None)
        conn.send(("ok", (os.getpid(), sum(p.numel() for p in model.parameters()))))
        _serve(engine, conn, follower)
    except (EOFError, KeyboardInterrupt):
        pass  # caller gone
    except BaseException as e:  # report a failed start instead of dying silently
        _send_quietly(conn, ("err", _describe(e)))
        code = 1
    finally:
        # Skip CB's stop (two gc passes) and interpreter teardown of torch + transformers:
        # together 2-3 s per worker, and this process holds nothing that needs them.
        conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(engine, conn, follower=None) -> None:
    handlers = _handlers(engine)
    posting = None
    while True:
        name, args = conn.recv()  # EOFError when the caller is gone
        if name == "close":
            return
        try:
            posting = _follow_memory(engine, follower, posting)
            reply = ("ok", handlers[name](*args))
        except Exception as e:  # the worker stays up; the caller raises
            reply = ("err", _describe(e))
        conn.send(reply)


def _follow_memory(engine, follower, last):
    """The KV room of the grant posted now (its memory beside the weights), before every command:
    a shrink preempts at once, a grow admits what waited.  Returns the posting applied."""
    posting = None if follower is None else follower.current()
    if posting is not last:
        engine.set_kv_limit(engine.kv_tokens_for(posting.mem_bytes) if posting is not None else None)
    return posting


def _handlers(engine) -> dict[str, Callable]:
    def submit(requests):
        for r in requests:
            engine.submit(r)

    def reset():
        engine.abort_all()
        engine.poll(0.0)
        engine.forward_steps()

    return {
        "submit": submit,
        "poll": lambda: (engine.poll(0.0), engine.forward_steps(), engine.holding()),
        "abort_all": engine.abort_all,
        "abort": engine.abort,
        "active": engine.active,
        "reset": reset,
        "status": lambda: _status(engine),
        "update_weights": lambda blob: engine.update_weights(_load_weights(blob)),
    }


def _status(engine) -> dict:
    import torch

    threads = {}
    for tid in _thread_ids():
        try:
            threads[tid] = tuple(sorted(os.sched_getaffinity(tid)))
        except ProcessLookupError:
            pass
    return {"pid": os.getpid(), "affinity": tuple(sorted(os.sched_getaffinity(0))), "thread_affinity": threads,
            "num_threads": torch.get_num_threads(), "generation_num_threads": engine.generation_num_threads,
            "active": engine.active(), "kv_limit": engine.kv_limit, "preempted": list(engine.preempted)}


def _thread_ids() -> list[int]:
    return [int(t) for t in os.listdir("/proc/self/task")]


def _load_weights(blob: bytes) -> dict:
    import torch

    return torch.load(io.BytesIO(blob), weights_only=True)  # tensors only: no code is unpickled


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}\n{traceback.format_exc()}"


def _send_quietly(conn, msg) -> None:
    try:
        conn.send(msg)
    except (OSError, ValueError):
        pass
