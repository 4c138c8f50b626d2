"""The demo's verl jobs: unmodified verl 0.9.1 GRPO on this CPU, timed from their own logs.

    verl_pipeline_cmd(cfg, seed, result)
        assets (once per --out-dir): tiny Qwen3 + GSM8K-format parquet (integrations/verl/assets.py)
        ─► python -m jigsaw.integrations.verl.watch --result R --rows P×G --name grpo-seedS --
               python -m verl.trainer.main_ppo <the CPU overrides of integrations/verl/job.py>
    The watcher writes R in the GRPO recipe's result layout, so the demo's modes, summary and
    report treat a verl job as one of its own pipelines.
"""

from __future__ import annotations

import sys
from pathlib import Path


def verl_pipeline_cmd(cfg, seed: int, result: Path) -> list[str]:
    from jigsaw.integrations.verl.assets import make_gsm8k, make_model
    from jigsaw.integrations.verl.job import JobConfig, grpo_command

    assets = Path(cfg.out_dir) / "verl-assets"
    model = make_model(assets / "model")
    if not (assets / "data" / "train.parquet").exists():
        make_gsm8k(assets / "data")
    job = JobConfig(model=model, data=assets / "data", seed=seed, steps=cfg.steps, prompts=cfg.prompts,
                    group=cfg.group, response_tokens=cfg.max_new_tokens, out=Path(cfg.out_dir) / f"verl-out-s{seed}")
    return [sys.executable, "-m", "jigsaw.integrations.verl.watch", "--result", str(result), "--rows",
            str(cfg.prompts * cfg.group), "--name", f"grpo-seed{seed}", "--", *grpo_command(job)]
