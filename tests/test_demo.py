"""The GRPO recipe and `jigsaw demo` end to end on this CPU (real processes, real engines)."""

import json
from pathlib import Path

import pytest

from jigsaw.cli.main import main
from jigsaw.recipes.grpo import RecipeConfig, _caps


def test_long_tail_caps_are_seeded_bounded_and_skewed():
    cfg = RecipeConfig(max_new_tokens=256, seed=3)
    caps = _caps(cfg, step=0, n=400)
    assert caps == _caps(cfg, step=0, n=400) and caps != _caps(cfg, step=1, n=400)
    assert min(caps) >= 2 and max(caps) == 256  # a few hit the budget
    assert sorted(caps)[200] < 0.3 * 256  # most are short: the median is about 0.2 × budget
    assert _caps(RecipeConfig(long_tail=False, max_new_tokens=64), 0, 5) == [64] * 5


@pytest.mark.timeout(600)
def test_demo_runs_serial_naive_naive_fair_and_jigsaw(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a user's directory, not the repository: the default is relative
    out = tmp_path / "demo"
    assert main(["demo", "--steps", "2", "--prompts", "2", "--group", "2", "--max-new-tokens", "24",
                 "--out-dir", "demo"]) == 0
    printed = capsys.readouterr().out
    for mode in ("serial", "naive", "naive-fair", "jigsaw"):
        docs = [json.loads(p.read_text()) for p in sorted(out.glob(f"{mode}-seed*.json"))]
        assert len(docs) == 2 and all(len(d["steps"]) == 2 and d["tokens"] > 0 for d in docs), mode
        assert mode in printed
    events = [json.loads(line) for line in (out / "jigsaw-trace.jsonl").read_text().splitlines()]
    granted = {e["pipeline"] for e in events if e["event"] == "grant"}
    assert granted == {"grpo-seed1", "grpo-seed2"}  # both pipelines went through the daemon
    kinds = {e["substage"].split("/")[3] for e in events if e["event"] == "grant"}
    assert {"reference", "training"} <= kinds and any(k.startswith("rollout_") for k in kinds)
    releases = [e for e in events if e["event"] == "release" and e["data"].get("flops")]
    assert releases  # FLOPs reach the trace, so the timeline has an MFU
    png = out / "jigsaw-timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Path(out / "daemon.log").exists()


def test_the_demo_table_counts_every_sub_stage_that_fell_open(tmp_path):
    from rich.console import Console

    from jigsaw.recipes.demo import _summarise, table

    def result(name: str, fell: int) -> Path:
        doc = {"name": name, "tokens": 100, "start_s": 10.0, "end_s": 20.0,
               "steps": [{"latency_s": 5.0}, {"latency_s": 5.0}],
               "fell_open": [{"kind": "training", "dp_rank": 0, "step": i, "substage": "", "reason": "unreachable"}
                             for i in range(fell)]}
        (path := tmp_path / f"{name}.json").write_text(json.dumps(doc))
        return path

    r = _summarise("jigsaw", 12.0, [result("a", 2), result("b", 1)])
    assert r.fell_open == 3 and r.tokens_per_s == 20.0
    console = Console(width=200, record=True)
    console.print(table([_summarise("serial", 25.0, [result("c", 0), result("d", 0)]), r]))
    row = next(line for line in console.export_text().splitlines() if "jigsaw" in line)
    assert row.rstrip(" │").endswith("3")  # the last column: sub-stages that fell open
