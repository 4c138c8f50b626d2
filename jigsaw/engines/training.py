"""GRPO trainer: FSDP2 (`fully_shard`) over gloo (CPU) or NCCL (a GPU per rank) in `world_size`
rank processes (started from procs.py's fork server).

    parent (Trainer)                                  rank r of world_size
    ────────────────                                  ──────────────────────────────
    TCPStore on 127.0.0.1:<OS-chosen port> ─────────► init_process_group("gloo", store)
                                                      load(model_config) → policy, fully_shard
                                                      per decoder layer + root; frozen unsharded
                                                      reference copy; AdamW on the shards
    train_step(samples, ref, group_size)
      group_advantages(rewards) ─┐
      split: contiguous slice per rank, the same number of micro-batches on every rank
      ("train", plain dicts) ────┴──────────────────► per micro-batch: collate → token_logprobs →
                                                      grpo_loss (÷ whole-batch token count) →
                                                      backward; clip_grad_norm_; optimizer.step
      sum of the ranks' partial metrics ◄──────────── ("ok", partial metrics)
    reference_logprobs / old_logprobs ──────────────► forward only (reference: no collectives)
    state_dict() ───────────────────────────────────► get_model_state_dict(full, cpu_offload):
                 ◄──────────────────────────────────   rank 0 returns the full tensors
    save(dir) / load(dir) ──────────────────────────► torch.distributed.checkpoint of the policy
                                                      and AdamW shards, every rank its own; load
                                                      reshards (a checkpoint of 2 ranks loads
                                                      into 1 or 4: a pipeline re-placed)
    pids() ─► whoever binds the ranks to a partition (the client, mux/partition/bind.py); each rank's
              intra-op threads follow the cores it may use, before every command
    board ──► each rank runs every micro-batch (forward, backward) on the stream of the grant its
              client posted for it, read again before each one (mux/partition/board.py)
    close() ────────────────────────────────────────► ("stop"); terminate / kill stragglers

Commands are (op, payload) tuples of plain data, never callables. A rank that fails answers
("error", its traceback); the parent then terminates every rank (its peers may be stuck in a
collective) and raises RuntimeError carrying that message. A rank that dies is noticed through
its process sentinel.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, Pipe, wait
from pathlib import Path
from typing import Any, Self

import torch

from jigsaw.engines import procs
from jigsaw.engines.grpo import (
    Sample,
    collate,
    group_advantages,
    grpo_loss,
    pad_rows,
    token_logprobs,
)
from jigsaw.engines.model import ModelConfig
from jigsaw.mux.partition.bind import follow_threads, on_stream
from jigsaw.mux.partition.board import Follower


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainConfig:
    """How the trainer optimises and how many rank processes it runs."""

    lr: float = 1e-3
    """AdamW learning rate (betas 0.9/0.999, no weight decay)."""
    clip_eps: float = 0.2
    """PPO ratio clip: ρ is kept in [1 - clip_eps, 1 + clip_eps]."""
    kl_coef: float = 0.02
    """Weight of the k3 KL estimator to the frozen reference."""
    micro_batch: int = 8
    """Samples per forward/backward on each rank; gradients accumulate over micro-batches."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip (the norm before clipping is reported)."""
    world_size: int = 2
    """Rank processes (FSDP2 shards over all of them)."""
    seed: int = 0
    """torch seed in every rank (the model weights come from ModelConfig.seed)."""
    threads_per_rank: int | None = None
    """torch intra-op threads of each rank; None: one per core the rank may use, followed
    before every command (a partition bound from outside changes them)."""
    start_timeout_s: float = 180.0
    """Longest wait for every rank to import torch, load the model and join the group."""
    op_timeout_s: float = 600.0
    """Longest wait for one command (a hung collective surfaces as an error, not a hang)."""


class Trainer:
    """GRPO on FSDP2 over gloo; see the module docstring. Use as a context manager.

    One command at a time: the methods are not safe to call from several threads at once.
    """

    def __init__(self, model_config: ModelConfig, config: TrainConfig | None = None, *, board: Path | None = None):
        """`board`: where the pipeline's client posts each rank's grant (Client.board); every
        rank runs its micro-batches on the stream of the grant posted for it.  None: no daemon."""
        config = config or TrainConfig()
        if model_config.device == "cuda" and config.world_size > max(1, torch.cuda.device_count()):
            raise ValueError(f"{config.world_size} ranks on {torch.cuda.device_count()} GPU(s): NCCL needs a GPU per "
                             f"rank (use world_size <= the GPUs)")
        self.board = board
        if config.world_size < 1 or config.micro_batch < 1:
            raise ValueError("world_size and micro_batch must be >= 1")
        self.config = config
        self.rank_samples: list[int] = []
        """Samples each rank trained on in the last train_step, as the ranks counted them."""
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._closed = False
        import torch.distributed as dist

        # The parent hosts the rendezvous store: port 0 lets the OS pick a free port atomically,
        # so there is no window in which another process can take it.
        self._store = dist.TCPStore("127.0.0.1", 0, world_size=config.world_size, is_master=True,
                                    wait_for_workers=False, timeout=timedelta(seconds=config.start_timeout_s))
        start_s = time.monotonic()
        try:
            self._spawn(model_config)
            self._gather(config.start_timeout_s)
        except BaseException:
            self.close(graceful=False)
            raise
        self.start_s = time.monotonic() - start_s  # start → every rank ready

    # ── public API ──────────────────────────────────────────────────────────────────────────
    def reference_logprobs(self, samples: Sequence[Sample],
                           shares: Sequence[int] | None = None) -> list[tuple[float, ...]]:
        """Reference-model log-prob of every output token, per sample (the "reference" sub-stage);
        `shares`: samples per rank (default near-equal), as a gang's grants size them."""
        return self._logprobs("ref_logprobs", samples, shares)

    def old_logprobs(self, samples: Sequence[Sample]) -> list[tuple[float, ...]]:
        """Current policy log-probs of every output token, before any update."""
        return self._logprobs("old_logprobs", samples)

    def train_step(self, samples: Sequence[Sample], ref_logprobs: Sequence[Sequence[float]] | None,
                   micro_batch: int | None = None, *, group_size: int,
                   shares: Sequence[int] | None = None) -> dict[str, float]:
        """One GRPO optimizer step on `samples` (groups of `group_size` consecutive samples).
        `shares`: samples per rank (default near-equal); the gradient is the same whatever the
        split (each rank's loss is its part of the whole batch's), only the ranks' pace differs.

        ref_logprobs: from reference_logprobs, or None to let the ranks compute them inline.
        Samples without old_logprobs use the current policy's (detached): exact for the
        single optimizer step per batch done here, and it saves a forward pass.
        Returns loss, kl, clip_frac (token means over the whole batch, before the update),
        grad_norm (before clipping), tokens (response tokens the policy sampled), reward_mean.
        """
        if not samples:
            raise ValueError("train_step needs at least one sample")
        if ref_logprobs is not None and len(ref_logprobs) != len(samples):
            raise ValueError(f"{len(ref_logprobs)} reference rows for {len(samples)} samples")
        advantages = group_advantages([s.reward for s in samples], group_size)
        tokens = sum(s.trained_tokens() for s in samples)
        rows = [_encode(s, adv=a, ref=None if ref_logprobs is None else ref_logprobs[i])
                for i, (s, a) in enumerate(zip(samples, advantages, strict=True))]
        plan = _plan(len(samples), self.config.world_size, micro_batch or self.config.micro_batch, shares)
        parts = self._call("train", [{"micro_batches": [[rows[i] for i in mb] for mb in rank_plan],
                                      "num_tokens": max(tokens, 1)} for rank_plan in plan])
        self.rank_samples = [int(p["samples"]) for p in parts]
        out = {key: sum(p[key] for p in parts) for key in ("loss", "kl", "clip_frac")}
        out |= {"grad_norm": parts[0]["grad_norm"], "tokens": float(tokens),
                "reward_mean": sum(s.reward for s in samples) / len(samples)}
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) policy weights on CPU, keyed like the unwrapped model's state_dict."""
        return self._call("state_dict", [{}] * self.config.world_size)[0]

    def save(self, directory: Path) -> None:
        """The policy and optimizer, sharded as the ranks hold them, into `directory` (new or
        empty; torch.distributed.checkpoint's format: any world size can load it)."""
        self._call("save", [{"dir": str(directory)}] * self.config.world_size)

    def load(self, directory: Path) -> None:
        """The policy and optimizer from a save(), whatever world size saved it."""
        if not (Path(directory) / ".metadata").is_file():
            raise FileNotFoundError(f"{directory}: not a trainer checkpoint (no .metadata)")
        self._call("load", [{"dir": str(directory)}] * self.config.world_size)

    def pids(self) -> list[int]:
        """Process ids of the ranks (for affinity checks and leak tests)."""
        return [p.pid for p in self._procs]

    def close(self, graceful: bool = True) -> None:
        """Stop every rank; stragglers are terminated, then killed. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if graceful:
            for conn in self._conns:
                try:
                    conn.send(("stop", {}))
                except (OSError, ValueError):
                    pass  # that rank is already gone
            _join_all(self._procs, timeout_s=10.0)
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        _join_all(self._procs, timeout_s=5.0)
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()
        self._store = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(graceful=exc[0] is None)

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.close(graceful=False)

    # ── parent side plumbing ────────────────────────────────────────────────────────────────
    def _spawn(self, model_config: ModelConfig) -> None:
        port = self._store.port
        for rank in range(self.config.world_size):
            parent_end, child_end = Pipe()
            proc = procs.process(_rank_main, (rank, port, dataclasses.asdict(model_config),
                                              dataclasses.asdict(self.config), child_end, self.board),
                                 name=f"jigsaw-train-rank{rank}")
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)

    def _logprobs(self, op: str, samples: Sequence[Sample],
                  shares: Sequence[int] | None = None) -> list[tuple[float, ...]]:
        rows = [_encode(s) for s in samples]
        plan = _plan(len(samples), self.config.world_size, self.config.micro_batch, shares)
        parts = self._call(op, [{"micro_batches": [[rows[i] for i in mb] for mb in rank_plan]}
                                for rank_plan in plan])
        return [row for part in parts for row in part]  # ranks hold consecutive slices

    def _call(self, op: str, payloads: list[dict]) -> list[Any]:
        if self._closed:
            raise RuntimeError("trainer is closed")
        for conn, payload in zip(self._conns, payloads, strict=True):
            conn.send((op, payload))
        return self._gather(self.config.op_timeout_s)

    def _gather(self, timeout_s: float) -> list[Any]:
        """One answer per rank; the first error, death or timeout closes all and raises."""
        results: list[Any] = [None] * len(self._procs)
        pending = set(range(len(self._procs)))
        deadline = time.monotonic() + timeout_s
        while pending:
            waitables = {self._conns[r]: r for r in pending} | {self._procs[r].sentinel: r for r in pending}
            ready = wait(list(waitables), timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                self._fail(f"ranks {sorted(pending)} did not answer within {timeout_s:.0f} s")
            for obj in ready:
                rank = waitables[obj]
                if rank not in pending:
                    continue
                if not self._conns[rank].poll():  # the sentinel fired and nothing is left to read
                    self._procs[rank].join(timeout=1.0)
                    self._fail(f"rank {rank} exited with code {self._procs[rank].exitcode}")
                status, value = self._conns[rank].recv()
                if status == "error":
                    self._fail(value)
                results[rank] = value
                pending.discard(rank)
        return results

    def _fail(self, message: str) -> None:
        self.close(graceful=False)  # peers may be blocked in a collective: do not wait for them
        raise RuntimeError(f"training rank failed: {message}")


def _encode(sample: Sample, adv: float = 0.0, ref: Sequence[float] | None = None) -> dict:
    """A sample as plain data for the pipe (the rank rebuilds the Sample)."""
    return {"prompt_ids": list(sample.prompt_ids), "output_ids": list(sample.output_ids),
            "reward": float(sample.reward), "advantage": float(adv),
            "old_logprobs": None if sample.old_logprobs is None else list(sample.old_logprobs),
            "loss_mask": None if sample.loss_mask is None else list(sample.loss_mask),
            "ref_logprobs": None if ref is None else [float(x) for x in ref]}


def _plan(num_samples: int, world_size: int, micro_batch: int,
          shares: Sequence[int] | None = None) -> list[list[list[int]]]:
    """Sample indices per rank per micro-batch: contiguous slices per rank, near-equal or of the
    `shares` given (a gang's grants skew them towards its faster ranks), and the same number of
    micro-batches on every rank (FSDP collectives need every rank in every forward and
    backward; a rank short of samples runs an empty, fully masked micro-batch)."""
    if shares is None:
        base, extra = divmod(num_samples, world_size)
        shares = [base + (rank < extra) for rank in range(world_size)]
    if len(shares) != world_size or sum(shares) != num_samples or min(shares) < 0:
        raise ValueError(f"shares {list(shares)} do not split {num_samples} samples over {world_size} ranks")
    bounds = [0]
    for n in shares:
        bounds.append(bounds[-1] + n)
    steps = max(1, math.ceil(max(shares) / micro_batch))
    plan = []
    for rank in range(world_size):
        idx = list(range(bounds[rank], bounds[rank + 1]))
        plan.append([idx[i * micro_batch:(i + 1) * micro_batch] for i in range(steps)])
    return plan


def _join_all(procs: Sequence[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(timeout=max(deadline - time.monotonic(), 0.0))


# ── rank side ──────────────────────────────────────────────────────────────────────────────
def _rank_main(rank: int, port: int, model_cfg: dict, train_cfg: dict, conn: Connection,
               board: Path | None = None) -> None:
    """Entry point of a rank process: set up, then serve commands until "stop" or EOF."""
    try:
        worker = _Rank(rank, port, ModelConfig(**model_cfg), TrainConfig(**train_cfg), board)
    except BaseException:  # noqa: BLE001 -- every failure goes to the parent, which raises it
        conn.send(("error", f"rank {rank} start-up: {traceback.format_exc()}"))
        return
    conn.send(("ok", None))
    while True:
        try:
            op, payload = conn.recv()
        except (EOFError, OSError):
            break  # the parent is gone
        if op == "stop":
            break
        try:
            conn.send(("ok", worker.handle(op, payload)))
        except BaseException:  # noqa: BLE001 -- reported to the parent, which closes every rank
            conn.send(("error", f"rank {rank} {op}: {traceback.format_exc()}"))
    worker.shutdown()


def follow_threads_per_layer(models, cap: int | None) -> None:
    """Threads follow the cores before every decoder layer, forward and backward: a budget that
    shrinks while one long command runs (a training step beside a partner that just began)
    would otherwise leave this rank's threads crowded onto fewer cores until the command ends,
    their parallel regions spinning on each other (seen in a demo trace: a 0.3 s training step
    took 2.3 s)."""

    def follow(*_):
        follow_threads(cap)

    for model in models:
        for layer in model.model.layers:
            layer.register_forward_pre_hook(follow)
            if any(p.requires_grad for p in layer.parameters()):
                layer.register_full_backward_pre_hook(follow)


class _Rank:
    """Policy shard, reference copy and optimizer of one rank."""

    def __init__(self, rank: int, port: int, model_config: ModelConfig, config: TrainConfig,
                 board: Path | None = None):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from jigsaw.engines.model import load

        follow_threads(config.threads_per_rank)
        torch.manual_seed(config.seed)
        cuda = model_config.device == "cuda"
        if cuda:  # one GPU per rank: NCCL refuses two ranks on one device
            torch.cuda.set_device(rank % torch.cuda.device_count())
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one node: keep gloo on loopback
        store = dist.TCPStore("127.0.0.1", port, world_size=config.world_size, is_master=False,
                              timeout=timedelta(seconds=config.start_timeout_s))
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=config.world_size,
                                timeout=timedelta(seconds=config.op_timeout_s))
        self.rank, self.config = rank, config
        self.follower = Follower(board)
        self.policy, tok = load(model_config)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.reference, _ = load(model_config)  # same config and seed: the initial policy
        self.reference.requires_grad_(False)
        mesh = init_device_mesh(self.device.type, (config.world_size,))
        for layer in self.policy.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.policy, mesh=mesh)
        self.policy.train()  # Qwen3 has no dropout by default; train() keeps intent explicit
        follow_threads_per_layer((self.policy, self.reference), config.threads_per_rank)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=config.lr, weight_decay=0.0)

    def handle(self, op: str, payload: dict) -> Any:
        follow_threads(self.config.threads_per_rank)  # the cores may have changed since the last command
        if op == "train":
            return self.train(payload["micro_batches"], payload["num_tokens"])
        if op in ("ref_logprobs", "old_logprobs"):
            return self.logprobs(op, payload["micro_batches"])
        if op == "state_dict":
            return self.full_state_dict()
        if op in ("save", "load"):
            return self.checkpoint(op, payload["dir"])
        raise ValueError(f"unknown command {op!r}")

    def batch(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """Collated micro-batch on this rank's device; an empty one becomes a single fully
        masked pad row."""
        if not rows:
            pad = Sample(prompt_ids=(self.pad_id,), output_ids=(self.pad_id,), reward=0.0)
            batch = collate([pad], self.pad_id)
            batch["response_mask"].zero_()
        else:
            batch = collate([Sample(prompt_ids=tuple(r["prompt_ids"]), output_ids=tuple(r["output_ids"]),
                                    reward=r["reward"], old_logprobs=_tuple_or_none(r["old_logprobs"]),
                                    loss_mask=None if r["loss_mask"] is None else tuple(r["loss_mask"]))
                             for r in rows], self.pad_id)
        return {key: value.to(self.device) for key, value in batch.items()}

    def forward(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return token_logprobs(model, batch["input_ids"], batch["attention_mask"],
                              batch["num_prompt_tokens"], batch["position_ids"])

    @torch.no_grad()
    def logprobs(self, op: str, micro_batches: list[list[dict]]) -> list[tuple[float, ...]]:
        model = self.reference if op == "ref_logprobs" else self.policy
        out: list[tuple[float, ...]] = []
        for rows in micro_batches:
            follow_threads(self.config.threads_per_rank)
            with on_stream(self.follower.stream(), work=op):  # the grant in force at this micro-batch
                logprobs = self.forward(model, self.batch(rows))  # empty ones still join collectives
            out.extend(tuple(logprobs[i, :len(r["output_ids"])].tolist()) for i, r in enumerate(rows))
        return out

    def train(self, micro_batches: list[list[dict]], num_tokens: int) -> dict[str, float]:
        sums = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0}
        self.optimizer.zero_grad(set_to_none=True)
        for step, rows in enumerate(micro_batches):
            follow_threads(self.config.threads_per_rank)  # a budget change mid-stage: at the next micro-batch
            # reduce-scatter once, after the last micro-batch's backward
            self.policy.set_requires_gradient_sync(step == len(micro_batches) - 1)
            batch = self.batch(rows)
            with on_stream(self.follower.stream(), work="train"):  # forward and backward on the grant
                logprobs = self.forward(self.policy, batch)
                loss, metrics = grpo_loss(
                    logprobs, batch.get("old_logprobs", logprobs.detach()), self.ref_rows(rows, batch),
                    torch.tensor([r["advantage"] for r in rows] or [0.0], device=self.device), batch["response_mask"],
                    self.config.clip_eps, self.config.kl_coef, num_tokens=num_tokens)
                # each rank's loss is its share of the batch mean: FSDP averages gradients over
                # ranks, so scale by world_size to get the gradient of the sum
                (loss * self.config.world_size).backward()
            for key in sums:
                sums[key] += metrics[key]
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.config.max_grad_norm)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # DTensor under FSDP2
        self.optimizer.step()
        return sums | {"grad_norm": float(norm), "samples": sum(len(rows) for rows in micro_batches)}

    def ref_rows(self, rows: list[dict], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Reference log-probs [B, R]: given by the parent, or computed here (no collectives)."""
        width = batch["response_mask"].shape[1]
        if rows and all(r["ref_logprobs"] is not None for r in rows):
            return pad_rows([r["ref_logprobs"] for r in rows], width).to(self.device)
        with torch.no_grad():
            return self.forward(self.reference, batch)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.policy, options=options)  # collective: every rank joins
        if self.rank != 0:
            return None
        # With one rank the "full" tensors can alias the live parameters, and sending a tensor
        # through the pipe moves its storage into shared memory: without the copy the parent
        # would hold a view that later optimizer steps keep changing.
        return {name: tensor.detach().clone() for name, tensor in state.items()}

    def checkpoint(self, op: str, directory: str) -> None:
        """Save or load the sharded policy and optimizer (collective: every rank joins)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, optim = get_state_dict(self.policy, self.optimizer)  # a fresh AdamW gets its state made
        state = {"model": model, "optim": optim}
        if op == "save":
            dcp.save(state, checkpoint_id=directory)
            return
        dcp.load(state, checkpoint_id=directory)  # into this rank's shards, resharded from the saver's
        set_state_dict(self.policy, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _tuple_or_none(values: Sequence[float] | None) -> tuple[float, ...] | None:
    return None if values is None else tuple(values)
