"""`jigsaw sim --lengths-from`: a user's logged lengths become a workload that replays them
exactly (jigsaw/sim/lengthlog.py): tables of lengths in JSONL and parquet under the column names
loggers use, verl's rollout dump counted by a tokenizer, and logs that cannot be a workload's
batch refused with the step that breaks it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jigsaw.sim import lengthlog
from jigsaw.sim import workload as wl

pytestmark = pytest.mark.timeout(60)


def _log(steps: int = 3, prompts: int = 4, group: int = 2, seed: int = 0) -> list[dict]:
    """verl-style metric names, a uid per prompt (as verl's GRPO groups by)."""
    rng = np.random.default_rng(seed)
    return [{"global_step": s + 1, "uid": f"s{s}p{p}", "prompt_length": int(rng.integers(20, 200)),
             "response_length": int(rng.integers(1, 5000))}
            for s in range(steps) for p in range(prompts) for _ in range(group)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _replayed(spec: wl.WorkloadSpec, steps: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t.sum()) for t in wl.sample_step(spec, rng, step=k).turn_tokens] for k in range(steps)]


def test_a_logged_table_becomes_a_workload_that_replays_it_exactly(tmp_path):
    rows = _log()
    rows[5]["response_length"] = 12_000  # past qwen3-4b-gsm8k's 8192 cap: the workload's cap must hold it
    log = lengthlog.read(_jsonl(tmp_path / "run.jsonl", rows))
    assert (log.steps, log.prompts, log.group) == (3, 4, 2)
    path = lengthlog.workload_from_log("qwen3-4b-gsm8k", log, tmp_path / "mine")
    spec = wl.load(path)
    assert (spec.prompts, spec.group, spec.model) == (4, 2, "qwen3-4b")
    assert spec.lengths.max_tokens >= max(r["response_length"] for r in rows)
    logged = [[r["response_length"] for r in rows if r["global_step"] == s + 1] for s in range(3)]
    assert _replayed(spec, 3) == logged
    assert "lengths-from" in spec.provenance["lengths.empirical"]


def test_parquet_logs_read_the_same_as_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _log(seed=1)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "run.parquet")
    assert lengthlog.read(tmp_path / "run.parquet").rows == lengthlog.read(_jsonl(tmp_path / "run.jsonl", rows)).rows


def test_jigsaws_own_recipe_lengths_are_read_as_they_are_written(tmp_path):
    # the recipe's --lengths-out lines (jigsaw/recipes/grpo.py): step, prompt_id, prompt_len, response_len
    rows = [{"step": s, "prompt_id": i // 4, "prompt_len": 30 + i, "response_len": 1 + 3 * i}
            for s in range(2) for i in range(8)]
    log = lengthlog.read(_jsonl(tmp_path / "lengths.jsonl", rows))
    assert (log.steps, log.prompts, log.group) == (2, 2, 4)


def test_verls_rollout_dump_is_counted_with_the_models_tokenizer(tmp_path):
    pytest.importorskip("transformers")
    from jigsaw.engines.model import ModelConfig, tokenizer

    tok = tokenizer(ModelConfig().vocab_size)
    tok.save_pretrained(tmp_path / "tok")
    dump = tmp_path / "rollout"
    dump.mkdir()
    texts = {1: ["what is 2 + 2", "what is 3 + 5"], 2: ["name a prime", "add 7 and 8"]}
    for step, prompts in texts.items():  # verl's _write_generations: one <step>.jsonl, n responses a prompt
        lines = [{"input": p, "output": "the answer is " + "four " * (k + 1), "score": 1.0, "step": step}
                 for p in prompts for k in range(2)]
        _jsonl(dump / f"{step}.jsonl", lines)
    with pytest.raises(ValueError, match="--lengths-tokenizer"):
        lengthlog.read(dump)
    log = lengthlog.read(dump, tokenizer=tmp_path / "tok")
    assert (log.steps, log.prompts, log.group) == (2, 2, 2)
    first = log.rows[0]
    assert first.prompt_len == len(tok("what is 2 + 2", add_special_tokens=False)["input_ids"])
    assert first.response_len == len(tok("the answer is four ", add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("rows,match", [
    (_log(prompts=4)[:8] + _log(prompts=3)[6:12], r"step 2 has 3 prompts × 2 responses, step 1 4 × 2"),
    ([{"step": 0, "uid": "a", "prompt_length": 10, "response_length": 5},
      {"step": 0, "uid": "a", "prompt_length": 10, "response_length": 5},
      {"step": 0, "uid": "b", "prompt_length": 10, "response_length": 5}], "different numbers of responses"),
    ([{"step": 0, "prompt_length": 10}], r"no response_len \(a column named one of response_len"),
    ([{"step": 0, "prompt_length": 10, "response_length": -3}], "response_len must be an integer >= 1"),
])
def test_a_log_that_cannot_be_a_batch_is_refused_naming_the_step_or_field(tmp_path, rows, match):
    with pytest.raises(ValueError, match=match):
        lengthlog.read(_jsonl(tmp_path / "bad.jsonl", rows))


def test_without_prompt_ids_the_group_splits_each_step(tmp_path):
    rows = [{"step": 0, "prompt_len": 10, "response_len": 1 + i} for i in range(6)]
    assert (lengthlog.read(_jsonl(tmp_path / "a.jsonl", rows), group=3).prompts) == 2
    with pytest.raises(ValueError, match="not a multiple of the group 4"):
        lengthlog.read(tmp_path / "a.jsonl", group=4)


def test_jigsaw_sim_lengths_from_simulates_the_log_and_keeps_the_workload(tmp_path, capsys):
    from jigsaw.cli.main import main

    rows = _log(steps=2, prompts=4, group=2)
    log = _jsonl(tmp_path / "run.jsonl", rows)
    out = tmp_path / "mine.toml"
    code = main(["sim", "--workload", "qwen3-0.6b-gsm8k,qwen3-0.6b-gsm8k", "--lengths-from", str(log),
                 "--lengths-out", str(out), "--steps", "2", "--policy", "jigsaw", "--no-trace", "--no-bound"])
    printed = " ".join(capsys.readouterr().out.split())
    assert code == 0, printed
    assert "16 samples in 2 step(s) of 4 prompts × 2" in printed
    spec = wl.load(out)
    assert spec.lengths.empirical.endswith("mine.jsonl") and (spec.prompts, spec.group) == (4, 2)
    assert "p0-mine" in printed and "p1-qwen3-0.6b-gsm8k" in printed
