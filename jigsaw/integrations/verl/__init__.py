"""jigsaw inside unmodified verl 0.9.1 jobs (`pip install -c constraints.txt -e '.[verl]'`).

    import verl (any process) ─► entry point `verl.plugins` ─► plugin.py
        ├─ cpu.py       the "cpu" platform (VERL_PLATFORM=cpu) and what verl needs on a host
        ├─ rollout.py   the rollout backend "jigsaw" (rollout.name=jigsaw): server.py, serving.py
        └─ trainer.py   under `jigsaw run`: verl's sync trainer, each stage admitted by the daemon
    assets.py: a tiny Qwen3 and GSM8K-format parquet files made locally, for tests and the demo
"""
