"""Engines of real RL pipelines (torch, transformers; CPU, or a GPU): what `jigsaw demo` and the recipes run.

    model.py     models and tokenizers, no download (a tiny Qwen3 made locally)
    rollout.py   RolloutEngine: one DP worker's generation on transformers' continuous batching
    dp.py        DPRollout: a worker process per DP rank; generate, poll, migrate, weights
    training.py  Trainer: FSDP2 over gloo (NCCL on GPUs) in rank processes (reference, GRPO step)
    procs.py     where workers and ranks start: a fork server that imported torch once
    forkserver_exit.py  the fork server's last preload: its own exit skips interpreter teardown
    grpo.py      GRPO math on plain tensors (advantages, log-probs, the loss)
    rewards.py   verifiable rewards (reasoning-gym tasks)
    sandbox.py   a tool call's sandbox: model-written Python with no network, bounded time and memory

Workers bind to their partitions through jigsaw.mux.partition (bind.py; board.py for what only the
worker itself can apply: a green side, the KV room); nothing here talks to the daemon
(the recipes feed the client: jigsaw/recipes/grpo.py).
"""
