"""`jigsaw run [--name N] [--profile GRID] [--devices N] -- CMD ...`: run a pipeline under the node daemon.
`jigsaw run --cluster ADDRESS --workload W -- CMD ...`: run it where the cluster places it
(cluster/launch.py arrive: the controller books it nodes, CMD runs there as a Ray task).

    daemon answering? ── no ─► node_info: probe (NVML GPUs, this process's cores) ─► choose
        │                        devices, grid, partitioner (--profile/--devices override) ─► say
        │                        so (stderr, daemon.log) ─► start `jigsaw daemon` detached with
        │                        idle_exit_s = ON_DEMAND_IDLE_EXIT_S (log in the runtime dir)
        │                        still none after start_timeout_s ─► run CMD unscheduled
        ▼
    register the pipeline with a fresh owner token (this process heartbeats for it; a name
    another job holds is refused: exit 2) ─► CMD as a child with JIGSAW_ENDPOINT /
    JIGSAW_PIPELINE / JIGSAW_OWNER ─► signals forwarded ─► unregister on exit
        ─► CMD's exit code (128 + N when it died of signal N)
    verl (detected in CMD, or --framework verl): CMD also gets RAY_RUNTIME_ENV_HOOK, so every Ray
        worker of the job gets the endpoint and the pipeline name; jigsaw's verl plugin (loaded
        by verl itself) admits each stage (jigsaw/integrations/verl/)
    unscheduled?  CMD of a framework without a jigsaw integration (sglang, openrlhf): said at
        start; otherwise, still running after warn_unscheduled_s and the daemon counts no
        sub-stage asked for by the pipeline: said once

A runtime directory that cannot be used (not private, not creatable) is said once and CMD
runs unscheduled: the pipeline never fails because the daemon cannot run.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro

from jigsaw.runtime.paths import ENV_ENDPOINT, ENV_OWNER, ENV_PIPELINE, kept_owner

ON_DEMAND_IDLE_EXIT_S = 600.0
"""A daemon `jigsaw run` starts exits after this long with no pipeline registered."""
FRAMEWORKS = ("verl", "sglang", "openrlhf")
"""Frameworks recognised in CMD."""
VERL_START_S = 300.0
"""A verl job is said unscheduled only after this long (its start-up takes minutes)."""
INTEGRATED = ("verl",)
"""Those whose jobs jigsaw schedules without a change to them (the others run unscheduled)."""
DETECTED = tyro.conf.arg(help_behavior_hint="(default: detected from the node)")


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """Run CMD (after `--`) as a pipeline scheduled by the node's jigsaw daemon; start the
    daemon if none is running.  If the daemon cannot be reached CMD still runs, alone."""

    name: Annotated[str | None, tyro.conf.arg(help_behavior_hint="(default: CMD's basename and this pid)")] = None
    """Pipeline name."""
    profile: Annotated[Path | None, DETECTED] = None
    """Slowdown grid for a daemon started on demand: a file, or a name such as h100/qwen3-4b.
    Detected: cpu/tiny-qwen3 without a GPU, else the prior of the GPU's kind (h100, a100) for qwen3-4b."""
    devices: Annotated[int | None, DETECTED] = None
    """Devices of a daemon started on demand.
    Detected: one per GPU that NVML sees, else 1 (a CPU device over this process's cores)."""
    start_daemon: bool = True
    """Start a daemon when none answers (--no-start-daemon: run CMD unscheduled instead)."""
    framework: Annotated[str | None, tyro.conf.arg(help_behavior_hint="(default: detected from CMD)")] = None
    """The RL framework CMD runs: verl | sglang | openrlhf | none.  verl jobs are scheduled
    through jigsaw's verl plugin (install jigsaw[verl] where verl runs)."""
    start_timeout_s: float = 10.0
    """How long to wait for a daemon started on demand."""
    slo: float | None = None
    """Slowdown SLO of CMD's steps: each may take at most this × its step alone on its devices
    (e.g. 1.3).  The scheduler co-locates and splits so as to keep it, says in `jigsaw daemon
    status` and the trace when it cannot, and counts the steps kept.  Unset: no SLO."""
    warn_unscheduled_s: float = 60.0
    """Warn once if CMD still runs after this many seconds without asking the daemon for a sub-stage
    (a verl job: at least 300 s, its start-up takes minutes).  0: never."""
    cluster: str = ""
    """Run CMD where the cluster's controller places it (a Ray address, or auto: this node's
    cluster; the [cluster] extra), beside the pipelines already running there, instead of under
    this node's daemon.  Each node runs `jigsaw daemon --cluster`; `{gpus}` in CMD becomes the
    GPUs it is given.  Needs --workload."""
    workload: str | None = None
    """With --cluster: what placement prices the pipeline as (a `jigsaw sim` workload name or file)."""
    cluster_policy: str = "jigsaw"
    """With --cluster: jigsaw (packed beside a running pipeline where jigsaw's trial keeps both
    within 2x their time alone, else nodes of its own) | hetrl (always nodes of its own) | rollmux."""
    cluster_replace: int = 0
    """With --cluster: re-place CMD up to this many times when a node it runs on leaves the cluster
    (stopped, run again where the controller places it then); CMD must go on from its own
    checkpoint (the recipe's --checkpoint-dir on storage every node sees).  0: it runs on."""
    cmd: Annotated[tuple[str, ...], tyro.conf.Suppress] = ()
    """The pipeline's command (given after `--`)."""


def run(args: Args) -> int:
    from jigsaw.runtime.client import Client

    if not args.cmd:
        raise ValueError("jigsaw run needs a command after `--`, e.g. jigsaw run -- python train.py")
    if args.slo is not None:
        from jigsaw.graph.slo import check_slo

        check_slo(args.slo)
    from jigsaw.protocol import check_name, safe_name

    name = check_name(args.name) if args.name else safe_name(f"{Path(args.cmd[0]).name}-{os.getpid()}")
    if args.cluster:
        return _in_cluster(args, name)
    framework = _framework(args)
    ep, why = _daemon(args)
    if ep is None:
        print(f"jigsaw run: {why}; running {name} unscheduled", file=sys.stderr)
    elif framework and framework not in INTEGRATED:
        _say(f"{framework} has no jigsaw integration in this version: {name}'s stages run unscheduled "
             f"(nothing in {framework} asks the jigsaw daemon for them)")
    token = secrets.token_hex(16)
    owner = Client(name, ep, owner=token, slo_slowdown=args.slo or 0.0)
    if owner.refusal is not None and owner.refusal.code == "name-taken":
        owner.close()
        raise ValueError(owner.refusal.message)
    env = dict(os.environ, **{ENV_PIPELINE: name, ENV_OWNER: token}, **({ENV_ENDPOINT: ep} if ep else {}))
    if framework == "verl" and ep is not None:
        env = _verl_env(env, name)
    with kept_owner(ep, name, token):  # for the job's workers started without this environment
        try:
            proc = subprocess.Popen(list(args.cmd), env=env)
        except OSError as exc:
            owner.close(pipeline_done=True)
            raise ValueError(f"cannot run {args.cmd[0]!r}: {exc}") from None
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, lambda s, f: proc.send_signal(s))
        watch = ep is not None and framework in (None, *INTEGRATED) and args.warn_unscheduled_s > 0
        # a verl job starts Ray, its workers and its models before its first stage: minutes on a busy host
        check_s = max(args.warn_unscheduled_s, VERL_START_S) if framework == "verl" else args.warn_unscheduled_s
        rc = _wait(proc, check_s if watch else 0.0, lambda: _check_scheduled(ep, name, args, check_s))
        owner.close(pipeline_done=True)
    return 128 - rc if rc < 0 else rc


def _in_cluster(args: Args, name: str) -> int:
    """CMD run where the cluster's controller places it (cluster/launch.py arrive); its exit code."""
    from jigsaw.cluster.launch import LaunchConfig, Submitted, arrive
    from jigsaw.cluster.simulate import PLACERS
    from jigsaw.extras import require
    from jigsaw.sim.workload import get

    if not args.workload:
        raise ValueError("--cluster needs --workload: what placement prices the pipeline as (e.g. qwen3-4b-gsm8k)")
    if args.cluster_policy not in PLACERS:
        raise ValueError(f"--cluster-policy {args.cluster_policy!r} unknown; choose from {', '.join(PLACERS)}")
    if args.cluster_replace < 0:
        raise ValueError(f"--cluster-replace is a count of re-placements, at least 0, got {args.cluster_replace}")
    get(args.workload)  # an unknown workload is a usage error, before the cluster is asked
    require("cluster", "jigsaw run --cluster")
    from jigsaw.cluster.controller import join

    join(args.cluster, "--cluster", log_to_driver=True)  # CMD's output comes back through Ray
    _say(f"{name}: asking the cluster's controller where it runs (trials of {args.workload}) ...")
    # a verl job's workers are Ray actors: the hook hands them the placement's environment
    hook = _verl_env(dict(os.environ), name).get("RAY_RUNTIME_ENV_HOOK") if _framework(args) == "verl" else None
    ran = arrive(Submitted(name=name, workload=args.workload, cmd=tuple(args.cmd),
                           env=(("RAY_RUNTIME_ENV_HOOK", hook),) if hook else ()),
                 LaunchConfig(policy=args.cluster_policy, replace_on_loss=args.cluster_replace), say=_say)
    _say(f"{name} ended with exit code {ran.returncode}")
    return 128 - ran.returncode if ran.returncode < 0 else ran.returncode


def _say(line: str) -> None:
    print(f"jigsaw run: {line}", file=sys.stderr)


# ------------------------------------------------------------------ unscheduled pipelines

def _framework(args: Args) -> str | None:
    if args.framework is None:
        return recognise(args.cmd)
    if args.framework not in (*FRAMEWORKS, "none"):
        raise ValueError(f"--framework {args.framework!r}: one of {', '.join(FRAMEWORKS)}, none")
    return None if args.framework == "none" else args.framework


def _verl_env(env: dict, name: str) -> dict:
    """CMD's environment with Ray's runtime-env hook set to hand jigsaw's env to every worker."""
    import importlib.util

    from jigsaw.integrations.verl.ray_env import HOOK

    if importlib.util.find_spec("verl") is None:
        _say(f"verl is not installed next to jigsaw ({sys.executable}): install jigsaw[verl] in verl's "
             f"environment, or {name}'s stages run unscheduled")
    if env.get("RAY_RUNTIME_ENV_HOOK", HOOK) != HOOK:
        _say(f"RAY_RUNTIME_ENV_HOOK is already {env['RAY_RUNTIME_ENV_HOOK']!r}: kept; Ray workers get jigsaw's "
             "env only by inheritance (a local Ray cluster)")
        return env
    _say(f"verl: {name}'s stages are admitted by the jigsaw daemon (jigsaw's verl plugin)")
    return dict(env, RAY_RUNTIME_ENV_HOOK=HOOK)


def verl_on_cpu(choice, probe, cmd: Sequence[str]):
    """On a node without GPUs, a verl job's fake GPUs (`trainer.n_gpus_per_node=N`) are what
    its replicas and ranks sit on: a device each, as on a GPU node (the per-core grid when
    that makes a core per device)."""
    from jigsaw.profiles import CPU_PER_CORE

    gpus = [int(m[1]) for word in cmd if (m := re.fullmatch(r"\+?trainer\.n_gpus_per_node=(\d+)", word))]
    if probe.gpus or not gpus or not 1 <= gpus[-1] <= probe.cores:
        return choice
    n = gpus[-1]
    return dataclasses.replace(choice, devices=n, profile=CPU_PER_CORE if probe.cores // n == 1 else choice.profile,
                               found=f"{choice.found}, verl with {n} GPU(s) per node")


def recognise(cmd: Sequence[str]) -> str | None:
    """The framework CMD runs, from its argv: a word that is a framework's package, a module in it
    (`-m verl.trainer.main_ppo`), or a directory on a path (`/opt/verl/trainer/main_ppo.py`)."""
    parts = [part for word in cmd for part in word.split("/")]
    for framework in FRAMEWORKS:
        if any(p == framework or p.startswith(f"{framework}.") for p in parts):
            return framework
    return None


def _wait(proc: subprocess.Popen, check_after_s: float, check: Callable[[], None]) -> int:
    """CMD's exit code; `check()` runs once if CMD still runs after `check_after_s` (0: never)."""
    if check_after_s > 0:
        try:
            return proc.wait(timeout=check_after_s)
        except subprocess.TimeoutExpired:
            check()
    return proc.wait()


def _check_scheduled(ep: str, name: str, args: Args, after_s: float) -> None:
    """Say so if the daemon counts no sub-stage asked for by pipeline `name`."""
    from jigsaw.runtime.client import status

    st = status(ep, 2.0)
    p = next((p for p in st.pipelines if p.name == name), None) if st is not None else None
    if p is not None and p.requested == 0:
        _say(f"{name} has asked the jigsaw daemon for no sub-stage in {after_s:g} s: it runs "
             f"unscheduled, nothing in `{shlex.join(args.cmd)[:80]}` has talked to the daemon.  Use the client API "
             "(jigsaw.runtime.client.connect) or an engine integration such as jigsaw.recipes.grpo "
             "(--warn-unscheduled-s 0 silences this).")


# ------------------------------------------------------------------ the daemon

def _daemon(args: Args) -> tuple[str | None, str]:
    """The endpoint of a daemon that answers (started if need be), or None and why not."""
    from jigsaw.runtime.client import ping
    from jigsaw.runtime.paths import endpoint, runtime_dir

    try:
        directory = runtime_dir()
        ep = endpoint(directory)
    except (OSError, ValueError) as exc:
        return None, str(exc)
    if ping(ep, 0.5):
        if args.profile is not None or args.devices is not None:
            _say(f"a daemon already answers at {ep}: --profile/--devices apply only to one started on demand")
        return ep, ""
    if args.start_daemon and _start_daemon(args, directory, ep):
        return ep, ""
    return None, f"no daemon at {ep} (see {directory / 'daemon.log'})"


def _start_daemon(args: Args, directory: Path, ep: str) -> bool:
    from jigsaw.runtime import node_info
    from jigsaw.runtime.client import wait_for_daemon

    probe = node_info.probe()
    choice = verl_on_cpu(node_info.choose(probe), probe, args.cmd) if _framework(args) == "verl" else \
        node_info.choose(probe)
    choice = dataclasses.replace(choice, devices=args.devices if args.devices is not None else choice.devices,
                                 profile=str(args.profile) if args.profile is not None else choice.profile)
    lines = [f"starting a daemon for this node ({choice.summary}; log {directory / 'daemon.log'})",
             *(f"warning: {w}" for w in choice.warnings)]
    cmd = [sys.executable, "-m", "jigsaw.cli.main", "daemon", "--devices", str(choice.devices), "--profile",
           choice.profile, "--partitioner", choice.partitioner, "--idle-exit-s", str(ON_DEMAND_IDLE_EXIT_S)]
    with open(directory / "daemon.log", "a") as log:
        for line in lines:
            _say(line)
            print(f"jigsaw run: {line}", file=log, flush=True)
        subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
    return wait_for_daemon(ep, args.start_timeout_s)
