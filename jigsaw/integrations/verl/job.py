"""A verl 0.9.1 GRPO job that fits this CPU machine: the command a user writes, nothing of jigsaw's.

    grpo_command(JobConfig) ─► ["python", "-m", "verl.trainer.main_ppo", overrides...]
    cpu_env()               ─► VERL_PLATFORM=cpu (the platform jigsaw's verl plugin registers)

Every override is verl's own Hydra key.  Why each non-obvious one is there (verl 0.9.1):
Ray sees only this machine's cores, and TransferQueue's controller and storage units each ask
for one (`ray_init.num_cpus`, one storage unit); verl places workers only on GPU bundles, so Ray
gets fake GPUs (`+ray_kwargs.ray_init.num_gpus`); FSDP1 and flash attention need CUDA (fsdp2,
sdpa); fp32 and no torch.compile keep a tiny model's steps short and its weight sync exact.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True, slots=True)
class JobConfig:
    """One GRPO job of verl's trainer on the host."""

    model: Path = Path("verl-assets/model")
    """HF checkpoint directory (assets.make_model writes one)."""
    data: Path = Path("verl-assets/data")
    """Directory with train.parquet and test.parquet (assets.make_gsm8k writes them)."""
    seed: int = 0
    """Data shuffling and weight-init seed of the trainer."""
    steps: int = 3
    """Training steps (`trainer.total_training_steps`)."""
    prompts: int = 4
    """Prompts per step (`data.train_batch_size`)."""
    group: int = 2
    """Responses per prompt (`rollout.n`)."""
    response_tokens: int = 16
    """`data.max_response_length`."""
    replicas: int = 2
    """Rollout replicas = trainer ranks (fake Ray GPUs); one engine per replica."""
    temperature: float = 1.0
    """Rollout sampling temperature (0: greedy)."""
    rollout: str = "jigsaw"
    """`actor_rollout_ref.rollout.name`."""
    out: Path | None = None
    """`trainer.default_local_dir` (checkpoints are off; verl writes little there)."""
    trainer_mode: str = "sync"
    """`trainer.v1.trainer_mode` (sync, or colocate_async: rollouts run ahead of training,
    interrupted and resumed at each weight update), or one of verl's experimental mains,
    one_step_off or fully_async (EXPERIMENTAL_MAINS), on their own rollout devices."""
    staleness: int = 2
    """The weight versions a trained sample may span: colocate_async's
    `trainer.v1.sampler.max_off_policy_threshold`; fully_async's
    `async_training.staleness_threshold` is this less one (weights synced every step);
    one_step_off's is 1 by definition."""
    rollout_dump: Path | None = None
    """`trainer.rollout_data_dir`: verl writes every step's prompts and responses here, as
    <step>.jsonl (None: not written)."""


EXPERIMENTAL_MAINS = {
    "one_step_off": "verl.experimental.one_step_off_policy.main_ppo",
    "fully_async": "verl.experimental.fully_async_policy.fully_async_main",
}
"""verl 0.9.1's experimental asynchronous trainers, each its own `python -m` main."""


def grpo_command(c: JobConfig) -> list[str]:
    rows = c.prompts * c.group
    per_rank = max(1, rows // c.replicas)
    a = "actor_rollout_ref"
    overrides = [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={c.data / 'train.parquet'}", f"data.val_files={c.data / 'test.parquet'}",
        f"data.train_batch_size={c.prompts}", "data.max_prompt_length=128",
        f"data.max_response_length={c.response_tokens}", f"data.seed={c.seed}", "data.dataloader_num_workers=0",
        f"{a}.model.path={c.model}", f"+{a}.model.override_config.attn_implementation=sdpa",
        f"{a}.actor.strategy=fsdp2", f"{a}.ref.strategy=fsdp2",
        f"{a}.actor.fsdp_config.dtype=float32", f"{a}.ref.fsdp_config.dtype=float32",
        f"{a}.actor.fsdp_config.seed={c.seed}",
        f"{a}.actor.use_torch_compile=False", f"{a}.ref.use_torch_compile=False",
        f"{a}.actor.ppo_mini_batch_size={c.prompts}", f"{a}.actor.ppo_micro_batch_size_per_gpu={per_rank}",
        f"{a}.actor.use_kl_loss=True", f"{a}.actor.kl_loss_coef=0.001",
        f"{a}.rollout.log_prob_micro_batch_size_per_gpu={per_rank}",
        f"{a}.ref.log_prob_micro_batch_size_per_gpu={per_rank}",
        f"{a}.rollout.name={c.rollout}", f"{a}.rollout.n={c.group}", f"{a}.rollout.temperature={c.temperature}",
        f"{a}.rollout.tensor_model_parallel_size=1", f"{a}.rollout.agent.num_workers=1",
        "reward.num_workers=1",
        "trainer.device=cpu", f"trainer.n_gpus_per_node={c.replicas}", "trainer.nnodes=1",
        f"trainer.total_training_steps={c.steps}", "trainer.logger=console", "trainer.val_before_train=False",
        "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.project_name=jigsaw",
        f"trainer.experiment_name=grpo-seed{c.seed}",
        "ray_kwargs.ray_init.num_cpus=16", f"+ray_kwargs.ray_init.num_gpus={c.replicas}",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]
    main = EXPERIMENTAL_MAINS.get(c.trainer_mode, "verl.trainer.main_ppo")
    if c.trainer_mode in EXPERIMENTAL_MAINS:
        overrides = _separate(c, overrides)
    elif c.trainer_mode != "sync":
        overrides += [f"trainer.v1.trainer_mode={c.trainer_mode}",
                      f"trainer.v1.sampler.max_off_policy_threshold={c.staleness}"]
    if c.rollout_dump is not None:
        overrides.append(f"trainer.rollout_data_dir={c.rollout_dump}")
    if c.out is not None:  # Hydra writes its run directory (outputs/<date>/...) under the cwd otherwise
        overrides += [f"trainer.default_local_dir={c.out}", f"hydra.run.dir={c.out / 'hydra'}"]
    return [sys.executable, "-m", main, *overrides]


def _separate(c: JobConfig, overrides: list[str]) -> list[str]:
    """An experimental main's overrides: as many rollout devices again as trainer ranks, the
    weights through the checkpoint engine "jigsaw" (weights.py; verl's default is NCCL).  Its
    config names verl's base config by a path relative to a verl checkout (one_step_off's), so
    the search path is the installed package's.  fully_async's rollouter takes prompts one by
    one (`gen_batch_size` 1, `train_batch_size` 0) up to `total_rollout_steps` of them, and
    its trainer steps every `ppo_mini_batch_size` prompts; its actors reserve 10 CPUs each."""
    drop = ("+ray_kwargs.ray_init.num_gpus=", "ray_kwargs.ray_init.num_cpus=")
    out = [o for o in overrides if not o.startswith(drop)]
    out += ["hydra.searchpath=[pkg://verl.trainer.config]", "actor_rollout_ref.hybrid_engine=False",
            "rollout.nnodes=1", f"rollout.n_gpus_per_node={c.replicas}",
            f"+ray_kwargs.ray_init.num_gpus={2 * c.replicas}",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=jigsaw"]
    if c.trainer_mode == "one_step_off":
        return out + ["ray_kwargs.ray_init.num_cpus=16"]
    out = [o for o in out if not o.startswith(("data.train_batch_size=", "trainer.total_training_steps="))]
    return out + ["ray_kwargs.ray_init.num_cpus=32", "data.train_batch_size=0", f"rollout.n={c.group}",
                  f"rollout.total_rollout_steps={c.steps * c.prompts}", "async_training.trigger_parameter_sync_step=1",
                  f"async_training.staleness_threshold={c.staleness - 1}"]


def cpu_env(base: dict | None = None) -> dict[str, str]:
    """The environment of a verl job on the host: the CPU platform selected."""
    env = dict(os.environ if base is None else base)
    env["VERL_PLATFORM"] = "cpu"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env
