"""jigsaw inside unmodified verl 0.9.1 jobs (`pip install -c constraints.txt -e '.[verl]'`).

    import verl (any process) ─► entry point `verl.plugins` ─► plugin.py
        ├─ cpu.py         the "cpu" platform (VERL_PLATFORM=cpu) and what verl needs on a host
        ├─ rollout.py     the rollout backend "jigsaw" (rollout.name=jigsaw): server.py (a replica
        │                 on jigsaw's engine), serving.py (its engine thread, regimes to the daemon)
        ├─ trainer.py     under `jigsaw run`: verl's sync trainer, each stage admitted by the daemon
        ├─ router.py      verl's rollout router is jigsaw's: balancer.py (the daemon's routing weights)
        └─ poll.py        opt-in shorter poll of verl's replay buffer (measurements)
    ray_env.py    what `jigsaw run` gives every Ray worker of a verl job
    placement.py  worker i is DP rank i mod the node's devices
    imports.py    run a function right after a module is first imported
    job.py        a verl GRPO job that fits this CPU (the command a user writes)
    assets.py     a tiny Qwen3 and GSM8K-format parquet files made locally, for tests and the demo
    watch.py      a verl job's steps timed from its own console log
"""
