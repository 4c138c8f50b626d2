"""Every command the README shows, run as a user would: from a directory outside the clone, in
order, block by block, with a private runtime directory and profile directory.

    README.md ─► ```bash blocks ─► commands (comments dropped; `# terminal N` lines run at once,
                                  in the background, and are waited for before the next line)
              ─► NOT_RUN: the commands too long for CI or needing a GPU, each with the reason
                  and the test that covers it instead; a command in neither fails the suite

A command passes when it exits with EXPECTED_RC (0 unless listed) within its block's deadline.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()

NOT_RUN = {
    "python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints.txt -e '.[dev]' "
    "--config-settings editable_mode=compat && jigsaw demo":
        "the install is what .ci/run does; the full demo takes minutes (tests/integration/test_demo.py runs it small)",
    "python -m pytest -q -n 2": "this suite (tests/integration/test_readme.py checks it is what .ci/run runs)",
    "python3 -m venv .venv-verl": "the verl venv .ci/run makes (tests/integration/test_readme.py checks the lines)",
    ".venv-verl/bin/pip install -c constraints.txt -e '.[dev,verl]' --config-settings editable_mode=compat":
        "the verl install .ci/run does (tests/integration/test_readme.py checks it)",
    ".venv-verl/bin/python -m pytest -q -m verl":
        "the verl suite .ci/run runs (tests/integration/test_readme.py checks it)",
    ".ci/no_torch.sh": "a fresh venv and a wheel built from the clone (a minute, the package index); .ci/run runs "
                       "it (tests/integration/test_readme.py checks it) and tests/integration/test_extras.py runs "
                       "the same commands here",
    "jigsaw demo": "4 modes × 3 repeats take minutes; the smoke run below runs every mode",
    "jigsaw demo --repeats 1 --steps 2 --prompts 2 --group 2 --max-new-tokens 24 --modes serial naive "
    "naive-fair static jigsaw": "tests/integration/test_demo.py::test_demo_runs_every_mode runs exactly this",
    "jigsaw demo --modes serial-live static-live --repeats 1 --steps 3 --out-dir calib":
        "tests/integration/test_demo.py::test_demo_runs_every_mode runs these two modes among the others (a minute "
        "more here) and the calibration below on their traces",
    "jigsaw profile --calibrate calib/serial-live-trace-r1.jsonl calib/static-live-trace-r1.jsonl --out my-cpu.json":
        "tests/integration/test_demo.py::test_demo_runs_every_mode runs it on its serial-live and static-live traces",
    "jigsaw profile --device cpu":
        "measures this machine for minutes; tests/unit/test_profiler.py measures a small grid",
    "jigsaw profile --device cuda --model qwen3-4b": "needs a GPU (tests/unit/test_profiler.py, gpu-marked)",
    "python bench/gpu_check.py --dry-run": "run from the clone, not outside it (tests/integration/test_gpu_check.py)",
    "python bench/gpu_check.py --out results/": "needs a GPU; its --dry-run is tests/integration/test_gpu_check.py",
    "python bench/gpu_check.py --only engines,profile --out results/":
        "needs a GPU; its --dry-run is tests/integration/test_gpu_check.py",
    "python -m jigsaw.recipes.grpo --steps 2 --train-ranks 2 --checkpoint-dir ckpt":
        "tests/integration/test_recipe_checkpoint.py runs it, smaller (the two runs take a minute here)",
    "python -m jigsaw.recipes.grpo --steps 3 --train-ranks 1 --checkpoint-dir ckpt":
        "tests/integration/test_recipe_checkpoint.py runs it, smaller, after the run above",
    "python -m jigsaw.recipes.grpo --tool-turns 3 --steps 2":
        "tests/integration/test_engine_agentic.py runs the recipe with --tool-turns 3 under a daemon",
    "jigsaw run --slo 1.3 -- python train.py":
        "a user's job; tests/integration/test_runtime.py::test_run_with_an_slo_registers_it_and_the_steps_are_"
        "measured_against_it runs `jigsaw run --slo` under a daemon",
    "python bench/slo.py": "a benchmark (4 minutes); the README shows its table",
    "jigsaw run --cluster auto --cluster-replace 2 --workload qwen3-0.6b-gsm8k --name math -- python -m "
    "jigsaw.recipes.grpo --steps 8 --checkpoint-dir /shared/ckpt/math --dp {gpus} --train-ranks {gpus}":
        "needs a Ray cluster of daemons; tests/integration/test_cluster_launch.py::test_an_arrival_whose_node_is_"
        "lost_is_placed_again_and_goes_on_from_its_checkpoint runs it through cluster/launch.py arrive",
    "jigsaw run --cluster auto --workload qwen3-4b-gsm8k --name math -- python train.py --dp {gpus}":
        "a user's job on a Ray cluster; tests/integration/test_cluster_launch.py::test_jigsaw_run_cluster_books_each_"
        "arriving_pipeline_nodes_and_runs_it_there runs `jigsaw run --cluster` on a local one",
    "jigsaw cluster --address auto":
        "needs a Ray cluster; tests/integration/test_cluster_launch.py::test_jigsaw_run_cluster_books_each_"
        "arriving_pipeline_nodes_and_runs_it_there runs it on a local one",
    "python bench/learned_grid.py --live --steps 32 --repeats 3": "a benchmark (11 minutes of CPU demo runs); "
                                                                   "the README shows its table",
    "python -m jigsaw.recipes.grpo --mode one-step-off --steps 4":
        "tests/integration/test_recipe_async.py runs the recipe one-step-off under a daemon beside a sync one",
    "python -m jigsaw.recipes.grpo --mode fully-async --steps 4":
        "tests/integration/test_recipe_async.py runs the recipe fully-async and kills its daemon mid-run",
    "jigsaw demo --async": "4 modes × 3 repeats take minutes; tests/integration/test_demo.py::test_the_async_"
                           "workload_runs_a_one_step_off_pipeline_beside_a_sync_one runs it small",
    "python bench/cpu_demo.py --workload async --modes serial naive-fair static jigsaw":
        "a benchmark (minutes); the README shows its table",
    "jigsaw demo --workload agentic": "4 modes × 3 repeats take minutes; tests/integration/test_demo.py checks the "
                                      "agentic pipeline's command and test_engine_agentic.py runs it under a daemon",
    "python bench/cpu_demo.py --workload agentic --modes serial naive-fair static jigsaw":
        "a benchmark (17 minutes); the README shows its table",
    "python bench/cpu_demo.py --workload agentic --pipelines 3 --modes serial naive-fair static jigsaw":
        "a benchmark (20 minutes); the README shows its table, and tests/integration/test_demo.py::"
        "test_three_pipelines_run_statically_split_by_cpu_time_and_under_jigsaw runs three pipelines small",
    "python bench/cpu_sim_vs_real.py --workload agentic --steps 5 --repeats 3 --out-dir /tmp/svr2":
        "a benchmark (20 minutes of CPU demo runs); the README shows its table, and tests/unit/test_replay.py "
        "checks the replay of a tool that computes",
    "python bench/cpu_sim_vs_real.py --workload agentic --pipelines 3 --steps 5 --repeats 2 --calibrate-on /tmp/svr2":
        "a benchmark (17 minutes, after the one above); the README shows its table",
    "jigsaw profile --model path/to/config.json --layers 4 --min-time-s 0.3": "needs a GPU and a model config",
    "jigsaw daemon --devices 8 --partitioner green --mps --telemetry-s 1 --trace node.jsonl":
        "needs GPUs and MPS (tests/unit/test_green.py, gpu-marked)",
    "jigsaw run --name job-a -- python -m verl.trainer.main_ppo data.train_files=a.parquet ...":
        "a user's verl job; tests/integration/test_verl_e2e.py runs two under jigsaw run (verl venv, .ci/run)",
    "jigsaw run --name job-b -- python -m verl.trainer.main_ppo data.train_files=b.parquet ...":
        "a user's verl job; tests/integration/test_verl_e2e.py runs two under jigsaw run (verl venv, .ci/run)",
}
EXPECTED_RC = {"jigsaw doctor --strict --json": 1 if not Path("/dev/nvidia0").exists() else 0}
SHOWS = {"jigsaw timeline --out node.html": ("grpo-a", "grpo-b")}
"""Outputs that must name these: both pipelines of the two terminals reached the daemon's trace."""
DEADLINE_S = 900
"""A hang detector, not a speed bound: the slowest block takes about 200 s on an idle 2-core machine,
twice that with a core busy."""


def _commands(block: str) -> list[tuple[str, bool]]:
    """(command, runs in the background) per line of a bash block; a comment starts at a `#`
    after two spaces (the README aligns them)."""
    out = []
    for line in block.splitlines():
        cmd, _, comment = (*re.split(r"(\s{2,}#)", line, maxsplit=1), "", "")[:3]
        if cmd.strip():
            out.append((cmd.strip(), comment.lstrip().startswith("terminal")))
    return out


BLOCKS = [_commands(b) for b in re.findall(r"```bash\n(.*?)```", README, flags=re.S)]


def test_every_readme_command_is_run_or_listed_with_a_reason():
    shown = {cmd for block in BLOCKS for cmd, _ in block}
    assert len(BLOCKS) >= 4 and shown
    assert set(NOT_RUN) <= shown, f"listed but no longer in the README: {set(NOT_RUN) - shown}"
    assert not re.search(r"\.\./|issue note", README)  # nothing points outside the repository


@pytest.fixture(scope="module")
def user_dir():
    """A user's working directory outside the clone, and short private runtime/profile dirs."""
    with tempfile.TemporaryDirectory(prefix="jw-") as tmp:
        rt = Path(tmp) / "rt"
        rt.mkdir(mode=0o700)
        (Path(tmp) / "work").mkdir()
        env = dict(os.environ, JIGSAW_RUNTIME_DIR=str(rt), JIGSAW_PROFILE_DIR=str(Path(tmp) / "profiles"),
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        env.pop("JIGSAW_ENDPOINT", None)
        yield Path(tmp) / "work", env
        subprocess.run([sys.executable, "-m", "jigsaw.cli.main", "daemon", "stop"], env=env, timeout=60,
                       capture_output=True)


@pytest.mark.timeout(DEADLINE_S + 60)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, user_dir):
    cwd, env = user_dir
    background, said = [], ""
    for cmd, in_background in BLOCKS[index]:
        if cmd in NOT_RUN:
            continue
        if in_background:
            background.append((cmd, subprocess.Popen(cmd, shell=True, cwd=cwd, env=env, text=True,
                                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)))
            continue
        for bg_cmd, proc in background:
            out, _ = proc.communicate(timeout=DEADLINE_S)
            assert proc.returncode == 0, f"{bg_cmd} exited {proc.returncode}:\n{out[-3000:]}"
            said += f"\n--- {bg_cmd}:\n{out[-1500:]}"  # what the jobs said, should a later command fail
        background = []
        done = subprocess.run(cmd, shell=True, cwd=cwd, env=env, text=True, capture_output=True, timeout=DEADLINE_S)
        assert done.returncode == EXPECTED_RC.get(cmd, 0), \
            f"{cmd} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}{said}"
        if out := re.search(r"--out (\S+)", cmd):  # what the command says it writes is there
            assert (cwd / out.group(1)).stat().st_size > 0, cmd
        for name in SHOWS.get(cmd, ()):
            assert name in (cwd / re.search(r"--out (\S+)", cmd).group(1)).read_text(), (cmd, name)
    for bg_cmd, proc in background:
        out, _ = proc.communicate(timeout=DEADLINE_S)
        assert proc.returncode == 0, f"{bg_cmd} exited {proc.returncode}:\n{out[-3000:]}"
