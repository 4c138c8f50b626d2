"""What `jigsaw run` gives every Ray worker of a verl job (Ray's own extension points).

    jigsaw run ─► env RAY_RUNTIME_ENV_HOOK=jigsaw.integrations.verl.ray_env.runtime_env_hook
    verl's driver: ray.init(runtime_env=…) ─► runtime_env_hook(runtime_env)
        + env_vars: JIGSAW_ENDPOINT, JIGSAW_PIPELINE, JIGSAW_OWNER, JIGSAW_NODES (placed across
          nodes by `jigsaw run --cluster`), and VERL_PLATFORM when set
        + worker_process_setup_hook = ray_env.setup (unless the job has its own)
    every Ray worker ─► setup(): once verl is imported there, jigsaw's verl plugin is loaded,
        even where verl's entry-point discovery is off (VERL_USE_EXTERNAL_PLUGINS=none)

A local Ray cluster inherits the driver's environment anyway; the env vars matter on a cluster
that was started before the job.  Under `uv run`, Ray ignores RAY_RUNTIME_ENV_HOOK unless
RAY_ENABLE_UV_RUN_RUNTIME_ENV=0.
"""

from __future__ import annotations

import os

from jigsaw.runtime.paths import ENV_ENDPOINT, ENV_NODES, ENV_OWNER, ENV_PIPELINE

HOOK = f"{__name__}.runtime_env_hook"
SETUP = f"{__name__}.setup"
FORWARDED = (ENV_ENDPOINT, ENV_PIPELINE, ENV_OWNER, ENV_NODES, "VERL_PLATFORM", "JIGSAW_VERL_POLL_S")


def runtime_env_hook(runtime_env: dict | None) -> dict:
    env = dict(runtime_env or {})
    env_vars = dict(env.get("env_vars") or {})
    for key in FORWARDED:
        if key in os.environ:
            env_vars.setdefault(key, os.environ[key])
    env["env_vars"] = env_vars
    env.setdefault("worker_process_setup_hook", SETUP)
    return env


def setup() -> None:
    import importlib

    from jigsaw.integrations.verl.imports import after_import

    after_import("verl", lambda _: importlib.import_module("jigsaw.integrations.verl.plugin"))
