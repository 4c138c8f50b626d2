"""The README's library example runs as written, prints what the README shows, and shows the
look-ahead beating greedy and serial."""

import contextlib
import io
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_example_runs(monkeypatch):
    text = (ROOT / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    monkeypatch.chdir(ROOT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    printed = out.getvalue()
    shown = re.search(r"It prints \(a test checks it, line for line\):\n\n```\n(.*?)```", text, flags=re.S)
    assert shown and printed == shown.group(1)  # the README shows what the example prints today
    spans = {int(w): float(s) for w, s in re.findall(r"W=(\d): both steps done in ([\d.]+) s", printed)}
    serial = float(re.search(r"serial: ([\d.]+) s", printed).group(1))
    assert set(spans) == {1, 2, 3}
    assert spans[3] <= spans[1] < serial and spans[2] < spans[1]
    assert re.search(r"GPU0 A/3/r0/\S+\s+\d+% SMs", printed)


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"(python3? -m )?pytest[^`\n]*", readme).group(0)
    assert command in (ROOT / ".ci" / "run").read_text()
    assert "-c constraints.txt" in (ROOT / ".ci" / "run").read_text()
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()
    assert os.access(ROOT / ".ci" / "run", os.X_OK)
