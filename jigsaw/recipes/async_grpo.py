"""The GRPO recipe as an asynchronous pipeline: rollout and training joined by a sample buffer.

    python -m jigsaw.recipes.grpo --mode one-step-off | fully-async [--staleness K] ...

    rollout thread (client: the job's name)            training thread (client: <name>.train)
      batch n: wait until buffer.may_generate(n)           step n: wait until buffer.ready(n)
        load the newest weights (version v) ─┐               take(n) ─► reference ─► training
        generate + reward (grpo.generate)    │                 ─► weights (version n + 1) ─┐
          fully-async: new weights mid-batch │                 ─► trained(n)               │
          ─► DPRollout.reload: requests stop,◄───────── newest weights ◄─────────────────────┘
             resume with their partial output
        put(n, samples born under v) ───────► SampleBuffer (graph/buffer.py, the simulator's)

The DP rollout workers and the trainer's ranks are processes of their own (engines/dp.py,
engines/training.py); each side's thread is the only caller of its engine.  Each side is a
pipeline of the job to the daemon (its own client, `job` = the job's name): the rollout side
keeps the job's name (what `jigsaw run` registered), the training side is `<name>.train`.
Without a daemon, or once it is gone, both sides run exclusively and nothing changes in what
is trained: the buffer, not the daemon, holds the staleness bound.

The result says, per trained step, the weight version its batch was generated under and its
staleness, per rollout batch how many requests a weight update stopped and resumed, and the
buffer's ledger (every sample trained, with its version and step).

With --checkpoint-dir each trained step is saved with the ledger (recipes/checkpoint.py), and a
run goes on after the last one saved: the buffer resumed at its version, the rollout side under
its weights; batches generated and never trained are generated again.  SIGTERM stops the run
as the synchronous one stops: the training step in flight ends and is saved, the batch being
generated is dropped (never trained: no sample is lost or trained twice).
"""

from __future__ import annotations

import threading
import time

from jigsaw.graph.buffer import DEFAULT_STALENESS, SampleBuffer, Trained, train_side

WAIT_S = 600.0
"""The longest either side waits for the other (a batch, a weight version) before it fails."""


class _Stopping(Exception):
    """The training side stopped (SIGTERM): the rollout side drops what it generates and ends."""


class Shared:
    """What the two threads share: the buffer, the generated samples, the newest weights."""

    def __init__(self, staleness: int, ledger: list[Trained] | None = None):
        """`ledger`: what a checkpoint's steps trained (the buffer goes on after them)."""
        self.buffer = SampleBuffer.resumed(staleness, ledger) if ledger else SampleBuffer(staleness)
        self.stopping = False
        self.cond = threading.Condition()
        self.samples: dict[int, list] = {}
        self.started: dict[int, float] = {}
        """Batch -> when its generation began (a trained step's life starts there)."""
        self.weights: dict[int, dict] = {}
        """Version -> the state dict the trainer published as it (the ones a batch may still need)."""
        self.failed: BaseException | None = None
        self.batches: list[dict] = []
        """Each batch generated, in order (a resumed run: the checkpoint's trained ones first)."""

    def wait(self, ready, what: str) -> None:
        """Block until `ready()` (under the lock), the other side failed, or WAIT_S passed."""
        deadline = time.monotonic() + WAIT_S
        while not ready():
            if self.stopping:
                raise _Stopping
            if self.failed is not None:
                raise RuntimeError(f"the other side failed while waiting for {what}") from self.failed
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"waited {WAIT_S:g} s for {what}")
            self.cond.wait(min(left, 1.0))


def run(cfg, name: str, mc, tok, task, say) -> dict:
    """Both sides to the end (module docstring); the recipe's result."""
    from jigsaw.engines.dp import DPRollout
    from jigsaw.engines.rollout import RolloutConfig
    from jigsaw.engines.training import TrainConfig, Trainer
    from jigsaw.recipes.checkpoint import StopAtStepEnd
    from jigsaw.runtime.client import connect

    k = cfg.staleness if cfg.staleness is not None else DEFAULT_STALENESS[cfg.mode]
    roll_client = connect(pipeline=name, steps=cfg.steps, max_tokens=cfg.max_new_tokens, job=name, mode=cfg.mode,
                          staleness=k)
    train_client = connect(pipeline=train_side(name), steps=cfg.steps, job=name, mode=cfg.mode, staleness=k)
    say(f"{cfg.mode}, staleness bound {k}; "
        f"{'under the jigsaw daemon' if roll_client.connected else 'alone (no daemon)'}")
    rollout = RolloutConfig(max_new_tokens=cfg.max_new_tokens, temperature=1.0, seed=cfg.seed, threads=cfg.threads)
    train = TrainConfig(world_size=cfg.train_ranks, seed=cfg.seed, threads_per_rank=cfg.threads)
    with StopAtStepEnd() as stop, DPRollout(mc, rollout, num_workers=cfg.dp, board=roll_client.board) as dp, \
            Trainer(mc, train, board=train_client.board) as trainer:
        steps, ledger, batches = _resume(cfg, trainer, say)
        resumed, shared = len(steps), Shared(k, ledger)
        shared.batches.extend(batches)
        if resumed:  # the rollout side's first batches generate under the checkpoint's weights
            shared.weights[resumed] = trainer.state_dict()
        params = dp.num_params
        side = threading.Thread(target=_guarded, name=f"{name}-rollout", daemon=True,
                                args=(shared, _rollout_side, cfg, roll_client, dp, task, tok, params, say))
        side.start()
        try:
            _train_side(cfg, shared, train_client, trainer, params, steps, stop, say)
        except BaseException as exc:
            with shared.cond:
                shared.failed = exc
                shared.cond.notify_all()
            raise
        finally:
            with shared.cond:  # stopped, or done: the rollout side has nothing more to generate for
                shared.stopping = True
                shared.cond.notify_all()
            side.join(timeout=WAIT_S)
        pids = {"rollout": list(dp.pids), "trainer": trainer.pids()}
    for c in (roll_client, train_client):
        c.close()
    fell = roll_client.fallen_open + train_client.fallen_open
    batches = shared.batches
    return {"name": name, "mode": cfg.mode, "staleness": k, "steps": steps, "batches": batches,
            "resumed_steps": resumed, "stopped": stop.requested, "tokens": sum(s["tokens"] for s in steps),
            "start_s": min(b["start_s"] for b in batches) if batches else 0.0,
            "end_s": steps[-1]["end_s"] if steps else 0.0,
            "ledger": [[t.uid, t.born_version, t.step] for t in shared.buffer.ledger],
            "fell_open": [{k: v for k, v in rec.items() if k != "reported"} for rec in fell], "pids": pids}


def _guarded(shared: Shared, fn, *args) -> None:
    """A side's thread: its failure reaches the other side (and the recipe) instead of a hang."""
    try:
        fn(shared, *args)
    except _Stopping:
        pass
    except BaseException as exc:
        with shared.cond:
            shared.failed = exc
            shared.cond.notify_all()


def _rollout_side(shared: Shared, cfg, client, dp, task, tok, params: int, say) -> None:
    from jigsaw.recipes import grpo_step as grpo
    from jigsaw.recipes.start_gate import wait_at_gate

    loaded, newest = 0, cfg.mode == "fully-async"
    for n in range(shared.buffer.version, cfg.steps):
        wait_at_gate(say, step=n)  # a demo's pipelines begin their first measured batch together
        with shared.cond:
            shared.wait(lambda n=n: shared.buffer.may_generate(n), f"weights for batch {n}")
            born = shared.buffer.weights_for(n, newest)
            state = shared.weights.get(born)
            for old in [v for v in shared.weights if v < born]:
                del shared.weights[old]  # no later batch generates under an older version
            shared.started[n] = start = time.time()
        if born != loaded:
            dp.update_weights(state)
            loaded = born
        resumed = dp.resumed

        def pick_up(d) -> None:  # fully async: newer weights reach the running batch
            nonlocal loaded
            with shared.cond:
                if shared.stopping:  # the batch is dropped: nothing will train it
                    raise _Stopping
                version = shared.buffer.version
                state = shared.weights.get(version)
            if newest and version > loaded and state is not None:
                d.reload(state)
                loaded = version

        samples = grpo.generate(cfg, n, client, dp, task, tok, params, on_poll=pick_up)
        client.step_end(n, tokens=0, samples=0)  # its tokens count once, when trained
        entry = {"batch": n, "weights_version": born, "resumed": dp.resumed - resumed, "start_s": start,
                 "end_s": time.time(), "lengths": grpo.lengths(samples)}
        with shared.cond:  # with the batch: a checkpoint of its step holds it
            shared.samples[n] = samples
            shared.buffer.put(n, [(n * len(samples) + i, born) for i in range(len(samples))])
            shared.batches.append(entry)
            shared.cond.notify_all()
        say(f"batch {n}: generated under weights v{born} in {time.time() - start:.2f} s"
            + (f", {dp.resumed - resumed} requests resumed under newer weights" if dp.resumed > resumed else ""))


def _train_side(cfg, shared: Shared, client, trainer, params: int, steps: list[dict], stop, say) -> None:
    """Steps len(steps) on, each appended to `steps` (and saved, with --checkpoint-dir), until
    the last, or a SIGTERM: a step in flight ends and is saved first."""
    with stop.steps(steps, cfg.checkpoint_dir is not None, say):
        for n in range(len(steps), cfg.steps):
            with shared.cond:  # a SIGTERM while waiting for the batch stops the run here
                shared.wait(lambda n=n: shared.buffer.ready(n), f"batch {n}")
                got = shared.buffer.take(n)
                samples, start = shared.samples.pop(n), shared.started.pop(n)
            with stop.step():
                steps.append(_train_step(cfg, shared, client, trainer, params, n, got, samples, start, say))
                if cfg.checkpoint_dir is not None:
                    _save(cfg, n, trainer, steps, shared)


def _train_step(cfg, shared: Shared, client, trainer, params: int, n: int, got, samples, start: float,
                say) -> dict:
    from jigsaw.recipes import grpo_step as grpo

    trained_s = time.time()
    metrics = grpo.train(cfg, n, client, trainer, samples, params)
    state = trainer.state_dict()
    tokens = sum(s.trained_tokens() for s in samples)
    client.step_end(n, tokens=tokens, samples=len(samples))
    with shared.cond:
        shared.weights[n + 1] = state
        shared.buffer.trained(n)
        shared.cond.notify_all()
    born, end = min(b for _, b in got), time.time()
    say(f"step {n}: trained batch {n} (weights v{born}, staleness {n - born}), {tokens} tokens, "
        f"loss {metrics['loss']:+.4f}")
    # a step's life: its batch's generation began, its training ended
    return {"step": n, "latency_s": end - start, "train_s": end - trained_s, "tokens": tokens,
            "samples": len(samples), "reward_mean": metrics["reward_mean"], "loss": metrics["loss"],
            "weights_version": born, "staleness": n - born, "start_s": start, "end_s": end,
            "lengths": grpo.lengths(samples)}


def _save(cfg, step: int, trainer, steps: list[dict], shared: Shared) -> None:
    from jigsaw.recipes.checkpoint import save

    with shared.cond:  # what steps 0..step trained; batches generated past it are generated again
        ledger = [[t.uid, t.born_version, t.step] for t in shared.buffer.ledger if t.step <= step]
        batches = [b for b in shared.batches if b["batch"] <= step]
    save(cfg.checkpoint_dir, step, trainer, steps, cfg, ledger=ledger, batches=batches)


def _resume(cfg, trainer, say) -> tuple[list[dict], list[Trained], list[dict]]:
    """(step results, buffer ledger, batches) a checkpoint under --checkpoint-dir holds, its
    weights and optimizer now the trainer's; nothing to start at step 0.  A synchronous run's
    checkpoint trained batch n at step n under the weights of step n - 1 (no ledger saved)."""
    from jigsaw.recipes.checkpoint import resume

    if (got := resume(cfg, trainer, say)) is None:
        return [], [], []
    per_batch = cfg.prompts * cfg.group
    rows = got.saved.get("ledger") or [[s["step"] * per_batch + i, s["step"], s["step"]]
                                       for s in got.steps for i in range(per_batch)]
    return list(got.steps), [Trained(*row) for row in rows], list(got.saved.get("batches", []))
