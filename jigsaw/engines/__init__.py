"""CPU engines of real RL pipelines (torch, transformers): what `jigsaw demo` and the recipes run.

    model.py     models and tokenizers, no download (a tiny Qwen3 made locally)
    rollout.py   RolloutEngine: one DP worker's generation on transformers' continuous batching
    dp.py        DPRollout: a worker process per DP rank; generate, poll, migrate, weights
    training.py  Trainer: FSDP2 over gloo in spawned rank processes (reference, GRPO step)
    grpo.py      GRPO math on plain tensors (advantages, log-probs, the loss)
    rewards.py   verifiable rewards (reasoning-gym tasks)

Workers bind to their partitions through jigsaw.mux.bind; nothing here talks to the daemon
(the recipes feed the client: jigsaw/recipes/grpo.py).
"""
