"""The verl assets' prompt picking (verl venv: the parquet needs pandas).

    make_model ─► long_rows(model, n, min_tokens)   picked with HF generate, greedy
               ─► jigsaw's rollout engine (what a verl replica serves), greedy, every candidate

Checked: the rows picked are exactly the first candidates the engine answers with no EOS in
`min_tokens` tokens (so a test that relies on them sees long rollouts), the filter rejects
some candidates, and asking for more long rows than the candidates hold is a clear error.
"""

from __future__ import annotations

import pytest

pytest.importorskip("pandas", reason="the verl extra installs pandas: pip install -c constraints.txt -e '.[verl]'")

pytestmark = [pytest.mark.verl, pytest.mark.timeout(300)]

CANDIDATES = 32
MIN_TOKENS = 24


def _engine_answers(model, rows) -> tuple[list[tuple[int, ...]], int]:
    """Each row's greedy answer (up to MIN_TOKENS tokens) from the engine, and the EOS id."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from jigsaw.engines.rollout import Request, RolloutConfig, RolloutEngine

    tok = AutoTokenizer.from_pretrained(model)
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with RolloutEngine(lm, tok, RolloutConfig(max_new_tokens=MIN_TOKENS, threads=1)) as engine:
        for i, r in enumerate(rows):
            ids = tok(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False))["input_ids"]
            engine.submit(Request(rid=str(i), prompt_ids=tuple(ids), max_new_tokens=MIN_TOKENS))
        done = {}
        while len(done) < len(rows):
            got = engine.poll(60.0)
            assert got, "the engine finished nothing in 60 s"
            done.update((c.rid, c.output_ids) for c in got)
        return [done[str(i)] for i in range(len(rows))], tok.eos_token_id


def test_long_rows_are_the_prompts_the_replicas_engine_answers_long(tmp_path):
    from jigsaw.integrations.verl.assets import gsm8k_rows, long_rows, make_model

    model = make_model(tmp_path / "model")
    candidates = gsm8k_rows(CANDIDATES, seed=0, split="train")
    answers, eos = _engine_answers(model, candidates)
    long = [r for r, out in zip(candidates, answers) if eos not in out and len(out) == MIN_TOKENS]
    assert 2 <= len(long) < CANDIDATES, len(long)  # a long tail: some answers end early, some run on
    assert long_rows(model, 2, min_tokens=MIN_TOKENS, candidates=CANDIDATES) == long[:2]
    with pytest.raises(ValueError, match=f"only {len(long)} of {CANDIDATES} prompts"):
        long_rows(model, len(long) + 1, min_tokens=MIN_TOKENS, candidates=CANDIDATES)
