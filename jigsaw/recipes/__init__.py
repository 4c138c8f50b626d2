"""Pipelines built from jigsaw's engines and client, and the demo that runs them side by side.

    grpo.py         one GRPO pipeline (`python -m jigsaw.recipes.grpo`), alone or under `jigsaw run`
    grpo_step.py    one step's pieces: generate (rollout, reward) and train (reference, update)
    checkpoint.py   its checkpoints: the trainer's shards and results after each step, resumed from
    async_grpo.py   the recipe asynchronous (--mode one-step-off | fully-async): rollout and
                    training threads joined by the sample buffer, each side a pipeline of its job
    agentic.py      its multi-turn rollout with a sandboxed code tool between turns (--tool-turns)
    gpu_grpo.py     a GRPO-shaped pipeline on one GPU, launching every forward on its grant's green stream
    demo.py         `jigsaw demo`: two pipelines serially, side by side, statically split, under jigsaw
    demo_report.py  what the demo's runs say, and whether to believe it
    verl_jobs.py    the demo's verl jobs (unmodified verl GRPO on this CPU)
    start_gate.py   the barrier that starts a run's pipelines' first measured step together
"""
