"""A user's logged response lengths ─► the empirical trace a workload replays (`jigsaw sim --lengths-from`).

    LOG ─┬─ a table of lengths, JSONL or parquet: a row per sample, its step, its prompt and response
         │  lengths in tokens (the column names verl's metrics, jigsaw's recipe and common loggers use:
         │  COLUMNS), optionally a prompt id (groups a step's samples) and its turns' lengths;
         │  jigsaw's own: `python -m jigsaw.recipes.grpo --lengths-out FILE`
         └─ verl's rollout dump (`trainer.rollout_data_dir`): <step>.jsonl files of input and output
            texts, counted in tokens by the model's tokenizer (a local directory; needs jigsaw[cpu])
    ─► rows ─► per step: prompts × group samples, the same in every step (what a workload replays;
       a step that differs is named)
    ─► write_trace: JSONL in the format lengths.load_trace reads
    ─► workload_from_log: the base workload's TOML with lengths.empirical, prompts and group of the
       log and a cap of at least its longest response, every change with its provenance
"""

from __future__ import annotations

import json
import tomllib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from jigsaw.sim import workload as wl
from jigsaw.sim.lengths import json_object

COLUMNS = {
    "step": ("step", "global_step", "global_steps", "training_step", "iteration"),
    "prompt_len": ("prompt_len", "prompt_length", "prompt_tokens", "num_prompt_tokens", "input_len", "input_tokens"),
    "response_len": ("response_len", "response_length", "response_tokens", "num_response_tokens", "output_len",
                     "output_tokens", "completion_tokens"),
    "prompt_id": ("prompt_id", "uid", "prompt_uid", "group_id", "index"),
    "turn_lens": ("turn_lens", "turn_lengths"),
}
"""Our field ─► the names a log may give it, tried in this order."""


@dataclass(frozen=True, slots=True)
class Row:
    """One logged sample."""

    step: int
    prompt_len: int
    response_len: int
    prompt_id: str | None = None
    turn_lens: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Log:
    """A log's samples, checked to be a replayable batch: `prompts` × `group` every step."""

    source: str
    rows: tuple[Row, ...]
    steps: int
    prompts: int
    group: int

    @property
    def longest_tokens(self) -> int:
        return max(r.response_len for r in self.rows)


def read(path: str | Path, *, tokenizer: str | Path | None = None, group: int | None = None) -> Log:
    """Every sample of a log (file or verl's dump directory), checked; `group` is what a step's
    samples are grouped by when the log names no prompt (default: one response per prompt)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"--lengths-from: {path} does not exist")
    if path.is_dir() or _is_text_dump(path):
        rows = list(_verl_dump(path, tokenizer))
    elif path.suffix == ".parquet":
        rows = [_row(f"{path} row {i + 1}", rec) for i, rec in enumerate(_parquet(path))]
    else:
        rows = [_row(f"{path}:{n}", rec) for n, rec in _jsonl(path)]
    if not rows:
        raise ValueError(f"{path}: no samples")
    return _checked(str(path), rows, group)


def write_trace(log: Log, path: str | Path) -> Path:
    """The log as an empirical trace (lengths.load_trace's format), one line a sample."""
    path = Path(path)
    with open(path, "w") as f:
        for r in log.rows:
            line = {"step": r.step, "prompt_len": r.prompt_len, "response_len": r.response_len}
            if r.prompt_id is not None:
                line["prompt_id"] = r.prompt_id
            if r.turn_lens:
                line["turn_lens"] = list(r.turn_lens)
            f.write(json.dumps(line) + "\n")
    return path


def workload_from_log(base: str, log: Log, out: str | Path) -> Path:
    """Write `out`.toml: workload `base` replaying the log's lengths (its trace `out`.jsonl beside
    it), with the log's prompts and group and a cap that holds its longest response."""
    import tomli_w

    out = Path(out).with_suffix("")
    trace = write_trace(log, out.with_suffix(".jsonl"))
    raw = tomllib.loads(_base_text(base))
    cap = max(int(raw.get("lengths", {}).get("max_tokens", 8192)), log.longest_tokens)
    raw.update(name=out.name, prompts=log.prompts, group=log.group,
               description=f"{raw.get('description', base)}, lengths replayed from {Path(log.source).name}")
    raw["lengths"] = {"empirical": trace.name, "max_tokens": cap}
    where = f"jigsaw sim --lengths-from {log.source}"
    prov = {k: v for k, v in raw.get("provenance", {}).items() if not k.startswith("lengths.")}
    raw["provenance"] = {**prov, "prompts": where, "group": where, "lengths.empirical": where,
                         "lengths.max_tokens": f"the longest of {where} or {base}'s cap"}
    path = out.with_suffix(".toml")
    path.write_text(f"# {raw['description']}\n" + tomli_w.dumps(raw))
    wl.load(path)  # what it wrote must load: the trace checked against prompts × group
    return path


# ---------------------------------------------------------------- reading

def _jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    with open(path) as f:
        for n, text in enumerate(f, 1):
            if text.strip():
                yield n, json_object(f"{path}:{n}", text)


def _parquet(path: Path) -> list[dict]:
    from jigsaw.extras import require

    require("logs", f"reading {path}")
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


def _field(rec: dict, key: str):
    return next((rec[name] for name in COLUMNS[key] if name in rec), None)


def _row(where: str, rec: dict) -> Row:
    def count(key: str, low: int) -> int:
        v = _field(rec, key)
        if v is None:
            raise ValueError(f"{where}: no {key} (a column named one of {', '.join(COLUMNS[key])})")
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{where}: {key} must be an integer >= {low}, got {v!r}")
        return v

    turns = _field(rec, "turn_lens") or ()
    if turns and (not isinstance(turns, list) or not all(isinstance(t, int) and t >= 1 for t in turns)):
        raise ValueError(f"{where}: turn_lens must be a list of positive integers, got {turns!r}")
    pid = _field(rec, "prompt_id")
    return Row(step=count("step", 0), prompt_len=count("prompt_len", 1), response_len=count("response_len", 1),
               prompt_id=None if pid is None else str(pid), turn_lens=tuple(turns))


def _is_text_dump(path: Path) -> bool:
    """A verl rollout dump file: its first record holds texts, not lengths."""
    if path.suffix != ".jsonl":
        return False
    first = next(_jsonl(path), (0, {}))[1]
    return "output" in first and _field(first, "response_len") is None


def _verl_dump(path: Path, tokenizer: str | Path | None) -> Iterator[Row]:
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if tokenizer is None:
        raise ValueError(f"{path} is verl's rollout dump (texts, not lengths): give the model's tokenizer "
                         "(--lengths-tokenizer DIR, a local directory with its tokenizer files)")
    count = _token_counter(tokenizer)
    for file in files:
        for n, rec in _jsonl(file):
            if "input" not in rec or "output" not in rec:
                raise ValueError(f"{file}:{n}: a verl dump line has 'input' and 'output', got {sorted(rec)}")
            step = rec.get("step", _step_of(file))
            yield Row(step=int(step), prompt_len=max(1, count(rec["input"])),
                      response_len=max(1, count(rec["output"])), prompt_id=str(rec["input"]))


def _step_of(file: Path) -> int:
    if not file.stem.isdigit():
        raise ValueError(f"{file}: no 'step' field and the file is not named <step>.jsonl")
    return int(file.stem)


def _token_counter(tokenizer: str | Path):
    from jigsaw.extras import require

    require("cpu", "counting a verl dump's tokens")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------- checking

def _checked(source: str, rows: list[Row], group: int | None) -> Log:
    """Rows grouped by step (ascending); every step prompts × group samples, the same everywhere."""
    steps = sorted({r.step for r in rows})
    shapes = {s: _shape(source, s, [r for r in rows if r.step == s], group) for s in steps}
    first = shapes[steps[0]]
    odd = [(s, p, g) for s, (p, g) in shapes.items() if (p, g) != first]
    if odd:
        s, p, g = odd[0]
        raise ValueError(f"{source}: step {s} has {p} prompts × {g} responses, step {steps[0]} "
                         f"{first[0]} × {first[1]}; a workload replays the same batch every step "
                         f"({len(odd)} step(s) differ: filter the log to the steps of one batch size)")
    ordered = tuple(r for s in steps for r in rows if r.step == s)
    return Log(source=source, rows=ordered, steps=len(steps), prompts=first[0], group=first[1])


def _shape(source: str, step: int, rows: list[Row], group: int | None) -> tuple[int, int]:
    ids = [r.prompt_id for r in rows]
    if all(i is None for i in ids):
        g = group or 1
        if len(rows) % g:
            raise ValueError(f"{source}: step {step} has {len(rows)} samples, not a multiple of the group {g}")
        return len(rows) // g, g
    if any(i is None for i in ids):
        raise ValueError(f"{source}: step {step} mixes samples with and without a prompt id")
    sizes = Counter(ids)
    if len(set(sizes.values())) != 1:
        counts = sorted(Counter(sizes.values()).items())
        raise ValueError(f"{source}: step {step}'s prompts have different numbers of responses "
                         f"({', '.join(f'{n} prompt(s) with {g}' for g, n in counts)})")
    return len(sizes), next(iter(sizes.values()))


def _base_text(base: str) -> str:
    known = wl.shipped()
    path = known.get(base) or Path(base)
    if not Path(path).is_file():
        raise KeyError(f"unknown workload {base!r}; shipped: {', '.join(sorted(known))}")
    return Path(path).read_text()


def summary(log: Log) -> Iterable[str]:
    """What was read, for the user: steps, batch, lengths."""
    lens = sorted(r.response_len for r in log.rows)
    yield (f"{log.source}: {len(log.rows):,} samples in {log.steps} step(s) of {log.prompts} prompts × "
           f"{log.group}; response tokens median {lens[len(lens) // 2]:,}, longest {lens[-1]:,}")
