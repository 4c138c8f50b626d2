"""The README's library example runs as written from outside the clone, prints what the README
shows, and shows the look-ahead beating greedy and serial; the client example runs; the package
is importable from the directory holding the clone; the README's commands are what CI runs."""

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_readme_example_runs(monkeypatch, tmp_path):
    text = (ROOT / "README.md").read_text()
    # The library example is the first; the others are the cluster controller's and the launch's,
    # which need a Ray cluster: tests/integration/test_cluster_ray.py and test_cluster_launch.py
    # make the same calls on one.
    code, controller, launching = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert "get_or_start" in controller and "NodeLink" in controller
    compile(launching, "README.md", "exec")
    import jigsaw.cluster.launch as launch

    assert all(hasattr(launch, n) for n in ("LaunchConfig", "Submitted", "launch"))
    monkeypatch.chdir(tmp_path)  # a user's directory: the grid is found by name, not by a relative path
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    printed = out.getvalue()
    shown = re.search(r"It prints \(a test checks it, line for line\):\n\n```\n(.*?)```", text, flags=re.S)
    assert shown and printed == shown.group(1)  # the README shows what the example prints today
    spans = {(int(w), int(e)): float(s)
             for w, e, s in re.findall(r"W=(\d), end game +(\d+): both steps done in ([\d.]+) s", printed)}
    serial = float(re.search(r"serial: ([\d.]+) s", printed).group(1))
    assert set(spans) == {(w, e) for w in (1, 2, 3) for e in (0, 12)}
    assert spans[3, 0] <= spans[1, 0] < serial and spans[2, 0] < spans[1, 0]
    assert all(spans[w, 12] < spans[w, 0] for w in (1, 2, 3))  # the end game pays here
    assert re.search(r"GPU0 A/3/r0/\S+\s+\d+% SMs", printed)


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"(python3? -m )?pytest[^`\n]*", readme).group(0)
    assert command in (ROOT / ".ci" / "run").read_text()
    install = re.search(r"pip install [^&\n]*", readme).group(0).strip()
    assert install in (ROOT / ".ci" / "run").read_text()  # CI installs the way the README does
    assert "-c constraints.txt" in install
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()
    assert os.access(ROOT / ".ci" / "run", os.X_OK)
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    verl = re.search(r"```bash\n(python3 -m venv \.venv-verl\n.*?)```", readme, flags=re.S).group(1).splitlines()
    assert verl and all(line in ci for line in verl), verl  # the verl suite, installed and run as CI does
    assert "```bash\n.ci/no_torch.sh\n```" in readme and ".ci/no_torch.sh" in ci  # and the install without torch
    assert "pip download" not in "\n".join(ci)  # the tests fetch what they need: the README's command is enough


@pytest.mark.timeout(120)
def test_readme_client_example_runs_without_a_daemon(tmp_path):
    (code,) = re.findall(r"```py\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JIGSAW_")}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("(exclusive, no daemon)") == 10  # 2 steps × 5 kinds, every grant exclusive


@pytest.mark.timeout(120)
def test_the_package_is_found_from_the_directory_holding_the_clone(tmp_path):
    """A clone named `jigsaw` in the working directory is a namespace package to Python; the
    README's install makes the real package win (the user saw "no attribute 'GraphBuilder'")."""
    (tmp_path / "jigsaw").symlink_to(ROOT)
    done = subprocess.run([sys.executable, "-c", "import jigsaw; print(jigsaw.GraphBuilder.__name__)"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0 and done.stdout.strip() == "GraphBuilder", done.stderr
