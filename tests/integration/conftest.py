"""Fixtures the engine tests share: the tiny model and the prompts they generate from."""

import pytest

TEXTS = ["Question: what is 3 + 4?", "Solve step by step.", "the a an is", "0 1 2 3",
         "<think> add the", "Question: what is 12 - 5?"]


@pytest.fixture(scope="module")
def model_and_tok():
    """The tiny Qwen3 (random weights, offline tokenizer) every engine process loads alike."""
    from jigsaw.engines.model import ModelConfig, load

    return load(ModelConfig())


@pytest.fixture(scope="module")
def prompts(model_and_tok):
    """(rid, prompt tokens) of TEXTS."""
    _, tok = model_and_tok
    return [(f"p{i}", tuple(tok.encode(t))) for i, t in enumerate(TEXTS)]
