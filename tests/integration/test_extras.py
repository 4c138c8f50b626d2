"""`pip install jigsaw` is the scheduler library, the simulator and the daemon, without torch: pyproject's
extras install what jigsaw.extras says they do, and with every optional module hidden (a sitecustomize
that refuses them, in every process started) the core commands work and the others say what to install.
.ci/no_torch.sh checks the same on a real install in a fresh venv."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from jigsaw import extras

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OPTIONAL = sorted({m.split(".")[0] for modules in extras.MODULES.values() for m in modules})

HIDE = """import importlib.abc, sys
HIDDEN = {hidden!r}
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden by the test)", name=name)
sys.meta_path.insert(0, Hide())
"""


def requirement_names(reqs: list[str]) -> set[str]:
    """Distribution names, a self-reference ("jigsaw[cpu,gpu]") expanded into its extras' names."""
    names = set()
    for req in reqs:
        name, extra = re.match(r"([A-Za-z0-9_.-]+)(?:\[([^\]]+)\])?", req).groups()
        if name == "jigsaw":
            for e in extra.split(","):
                names |= requirement_names(PYPROJECT["optional-dependencies"][e])
        else:
            names.add(name.lower())
    return names


@pytest.mark.parametrize("extra", sorted(extras.MODULES), ids=lambda e: f"[{e}]")  # a bare "gpu" id reads as the marker
def test_each_extra_installs_the_modules_jigsaw_imports_from_it(extra):
    installs = requirement_names(PYPROJECT["optional-dependencies"][extra])
    wanted = {extras.DISTRIBUTIONS.get(m, m) for m in extras.MODULES[extra]}
    assert wanted <= installs, wanted - installs


def test_the_core_install_has_no_optional_dependency():
    core = requirement_names(PYPROJECT["dependencies"])
    optional = {extras.DISTRIBUTIONS.get(m, m) for modules in extras.MODULES.values() for m in modules}
    assert not core & optional, core & optional
    assert requirement_names(PYPROJECT["optional-dependencies"]["dev"]) >= \
        requirement_names(PYPROJECT["optional-dependencies"]["cpu"] + PYPROJECT["optional-dependencies"]["gpu"])


def test_a_missing_extra_is_named_with_the_command_to_install_it(monkeypatch):
    monkeypatch.setitem(extras.MODULES, "cpu", ("torch", "no_such_module_here", "reasoning_gym"))
    monkeypatch.setitem(extras.DISTRIBUTIONS, "no_such_module_here", "no-such-dist")
    with pytest.raises(extras.MissingExtra) as err:
        extras.require("cpu", "jigsaw demo")
    assert str(err.value) == "jigsaw demo needs no-such-dist, which is not installed: pip install 'jigsaw[cpu]'"
    assert isinstance(err.value, ImportError)


@pytest.fixture
def hidden(tmp_path):
    """An environment whose Python processes cannot import any optional dependency, and a runtime dir."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE.format(hidden=OPTIONAL))
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JIGSAW_")}
    env.update(PYTHONPATH=os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               JIGSAW_RUNTIME_DIR=str(rt), JIGSAW_PROFILE_DIR=str(tmp_path / "profiles"))
    return env


def jigsaw(env: dict, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jigsaw.cli.main", *args], env=env, cwd=env["JIGSAW_RUNTIME_DIR"],
                          capture_output=True, text=True, timeout=timeout_s)


def test_the_hiding_works(hidden):
    done = subprocess.run([sys.executable, "-c", "import torch"], env=hidden, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1 and "hidden by the test" in done.stderr


@pytest.mark.timeout(180)
def test_without_the_extras_the_core_commands_work(hidden, tmp_path):
    code = ("import jigsaw, jigsaw.graph, jigsaw.sim, jigsaw.runtime.daemon, jigsaw.runtime.client\n"
            "print(jigsaw.load_grid('h100/qwen3-4b').device.sku, len(jigsaw.profiles.available()))")
    done = subprocess.run([sys.executable, "-c", code], env=hidden, capture_output=True, text=True, timeout=60)
    shipped = len(list((ROOT / "profiles").glob("*/*.json")))
    assert done.returncode == 0 and done.stdout.split() == ["H100-SXM5-80GB", str(shipped)], done.stderr
    for args in (["--help"], ["sim", "--list"], ["inspect", "h100/qwen3-4b"],
                 ["prior", "--device", "h100", "--model", "qwen3-0.6b"],
                 ["sim", "--workload", "qwen3-0.6b-gsm8k,qwen3-0.6b-gsm8k", "--policy", "jigsaw", "--steps", "1",
                  "--no-bound", "--out", str(tmp_path / "t.jsonl")],
                 ["timeline", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "t.json")]):
        done = jigsaw(hidden, *args)
        assert done.returncode == 0, (args, done.stderr)
    log = tmp_path / "daemon.log"
    with open(log, "wb") as out:  # a file: a pipe nobody drains would stop the daemon at a log line
        daemon = subprocess.Popen([sys.executable, "-m", "jigsaw.cli.main", "daemon", "--no-trace"], env=hidden,
                                  stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 60
        while jigsaw(hidden, "daemon", "status").returncode != 0:
            assert daemon.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the daemon did not answer in 60 s"
            time.sleep(0.2)
        ran = jigsaw(hidden, "run", "--name", "core", "--", sys.executable, "-c", "print('ran')")
        assert ran.returncode == 0 and ran.stdout.strip() == "ran", ran.stderr
        assert jigsaw(hidden, "daemon", "stop").returncode == 0
        assert daemon.wait(30) == 0
        # no daemon answers: `jigsaw run` starts one, on this node's CPU grid (no NVML: no GPU, and it says why)
        ran = jigsaw(hidden, "run", "--name", "on-demand", "--", sys.executable, "-c", "print('ran')")
        assert ran.returncode == 0 and ran.stdout.strip() == "ran", ran.stderr
        assert "nvidia-ml-py is not installed" in ran.stderr and "partitioner cpu" in ran.stderr, ran.stderr
    finally:
        jigsaw(hidden, "daemon", "stop")
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()


@pytest.mark.timeout(180)
def test_without_the_extras_the_other_commands_say_what_to_install(hidden, tmp_path):
    assert jigsaw(hidden, "sim", "--workload", "qwen3-0.6b-gsm8k", "--steps", "1", "--no-bound",
                  "--out", str(tmp_path / "t.jsonl")).returncode == 0
    for args, extra in ((["demo"], "cpu"), (["profile", "--device", "cpu"], "cpu"),
                        (["profile", "--device", "cuda"], "gpu"),
                        (["timeline", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "t.png")], "timeline"),
                        (["timeline", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "t.html")], "timeline"),
                        (["cluster"], "cluster"),
                        (["run", "--cluster", "auto", "--workload", "qwen3-0.6b-math", "--", "true"], "cluster")):
        done = jigsaw(hidden, *args)
        assert done.returncode == 2 and f"pip install 'jigsaw[{extra}]'" in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
    recipe = subprocess.run([sys.executable, "-m", "jigsaw.recipes.grpo", "--steps", "1"], env=hidden,
                            capture_output=True, text=True, timeout=60)
    assert recipe.returncode == 2 and "pip install 'jigsaw[cpu]'" in recipe.stderr, recipe.stderr
    doctor = jigsaw(hidden, "doctor")
    assert doctor.returncode == 0 and "pip install 'jigsaw[gpu]'" in doctor.stdout, doctor.stderr
    probe = subprocess.run([sys.executable, "-c", "from jigsaw.runtime import node_info; "
                            "print(node_info.probe().no_gpu)"], env=hidden, capture_output=True, text=True, timeout=60)
    assert "pip install 'jigsaw[gpu]'" in probe.stdout, probe.stderr
