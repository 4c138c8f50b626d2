"""A multi-turn pipeline with a real code tool (recipes/agentic.py): a request waiting for its tool
resumes with its whole context, the tool's output is context and never trained on, and the tool
wait is a tool sub-stage that gives the worker's device back."""

import subprocess
import sys

import pytest
from nodes import ROOT, Node

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jigsaw.engines.dp import DPRollout
from jigsaw.engines.grpo import Sample, collate
from jigsaw.engines.model import ModelConfig
from jigsaw.engines.rollout import RolloutConfig
from jigsaw.engines.sandbox import SandboxConfig, run_python
from jigsaw.recipes import agentic
from jigsaw.recipes.grpo import RecipeConfig
from jigsaw.recipes.grpo_step import _rollout
from jigsaw.runtime.client import connect


def test_a_turns_code_is_its_own_block_else_the_scaffolds():
    item = {"metadata": {"expression": "5 - 3 - 6"}}
    assert agentic.code_of("let me compute\n```python\nprint(2 ** 10)\n```", item) == "print(2 ** 10)\n"
    assert agentic.code_of("the a an", item) == "print(5 - 3 - 6)"
    assert agentic.observation(run_python("print(5 - 3 - 6)")) == "\nOutput: -4\n"


def test_given_tokens_are_context_not_trained_on():
    s = Sample(prompt_ids=(5, 6), output_ids=(7, 8, 9, 10), reward=1.0, loss_mask=(1, 0, 0, 1))
    assert collate([s], pad_id=0)["response_mask"].tolist() == [[1.0, 0.0, 0.0, 1.0]]
    assert s.trained_tokens() == 2
    with pytest.raises(ValueError, match="loss-mask"):
        collate([Sample(prompt_ids=(5,), output_ids=(7, 8), reward=0.0, loss_mask=(1,))], pad_id=0)


@pytest.fixture(scope="module")
def dp():
    with DPRollout(ModelConfig(), RolloutConfig(threads=1), num_workers=2) as d:
        yield d


def _turns(cfg, client, dp):
    """One turn of every sample, as the recipe generates it."""
    return lambda prompts, turn: _rollout(cfg, 0, client, dp, prompts, 1, turn=turn)


@pytest.mark.timeout(300)
def test_a_request_waiting_for_its_tool_resumes_with_its_context_token_identical(model_and_tok, prompts, dp):
    """Greedy: each turn equals a fresh generation from prompt + earlier turns + the same tool outputs."""
    _, tok = model_and_tok
    items = [{"metadata": {"expression": f"{i} * 7"}} for i in range(len(prompts))]
    cfg = RecipeConfig(tool_turns=3, max_new_tokens=12, long_tail=False, tool_workers=2, dp=2)
    client = connect(pipeline="agentic-test", endpoint="")
    turns = agentic.rollout(cfg, 0, client, dp, prompts, items, tok, SandboxConfig(), _turns(cfg, client, dp))
    for t, item in zip(turns, items):
        assert len(t.calls) == 2 and all(c.status == "ok" for c in t.calls)
        context, expected_mask = list(t.prompt_ids), []
        for k in range(3):  # replay: one turn from the whole context, then the same tool call
            fresh = dp.generate([("x", tuple(context))], 12)[0].output_ids
            context += fresh
            expected_mask += [1] * len(fresh)
            if k < 2:
                result = run_python(agentic.code_of(tok.decode(list(fresh), skip_special_tokens=True), item))
                obs = tok(agentic.observation(result))["input_ids"]
                context += obs
                expected_mask += [0] * len(obs)
        assert tuple(context[len(t.prompt_ids):]) == tuple(t.output_ids), f"{t.rid} lost or changed its context"
        assert t.loss_mask == expected_mask and len(t.logprobs) == len(t.output_ids)
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if not m)
    client.close()


BAD = {"timeout": "__import__('time').sleep(60)", "crashed": "__import__('os').abort()",
       "output-cut": "'x' * 10 ** 7", "error": "__import__('socket').create_connection(('1.1.1.1', 80), timeout=3)"}


@pytest.mark.timeout(300)
def test_bad_tool_calls_are_cut_off_told_to_the_model_and_logged_and_the_rollout_goes_on(model_and_tok, prompts, dp):
    _, tok = model_and_tok
    items = [{"metadata": {"expression": code}} for code in BAD.values()]
    cfg = RecipeConfig(tool_turns=2, max_new_tokens=8, long_tail=False, tool_workers=4)
    logged: list[str] = []
    client = connect(pipeline="bad-tools", endpoint="")
    turns = agentic.rollout(cfg, 0, client, dp, prompts[:4], items, tok, SandboxConfig(timeout_s=8.0),
                            _turns(cfg, client, dp), say=logged.append)
    client.close()
    assert [t.calls[0].status for t in turns] == list(BAD)
    notes = {"timeout": "time limit", "crashed": "signal", "output-cut": "output limit", "error": "unreachable"}
    for t, (status, note) in zip(turns, notes.items()):
        told = tok.decode([x for x, m in zip(t.output_ids, t.loss_mask) if not m])
        assert note in told, f"{status}: the model was told {told!r}"
        assert any(t.rid in line and status in line for line in logged), logged
        assert sum(t.loss_mask) > 0 and len(t.output_ids) > sum(t.loss_mask)  # both turns ran


@pytest.mark.timeout(600)
def test_a_tool_wait_is_a_tool_substage_and_the_worker_holds_no_device_during_it(tmp_path):
    node = Node(tmp_path)
    node.start("--partitioner", "cpu")
    try:
        res = subprocess.run([sys.executable, "-m", "jigsaw.cli.main", "run", "--name", "agent", "--", sys.executable,
                              "-m", "jigsaw.recipes.grpo", "--steps", "2", "--prompts", "2", "--group", "2",
                              "--max-new-tokens", "16", "--tool-turns", "3", "--result", str(tmp_path / "r.json")],
                             env=node.env, cwd=ROOT, capture_output=True, text=True, timeout=540)
        assert res.returncode == 0, res.stderr[-3000:]
        events = node.left("agent")
    finally:
        node.stop()
    def span(sid: str, first: str, last: str) -> tuple[float, float]:
        at = {e["event"]: e["t_s"] for e in events if e["substage"] == sid}
        return at[first], at[last]

    sids = {e["substage"] for e in events if e["pipeline"] == "agent" and e["substage"]}
    tools = {sid: span(sid, "host", "done") for sid in sids if "/tool/" in sid}  # host work: never granted
    assert len(tools) == 2 * 2, f"one tool sub-stage per step and call round: {sorted(tools)}"
    assert not [e for e in events if e["event"] == "grant" and e["substage"] in tools]
    device = {sid: span(sid, "grant", "release") for sid in sids
              if any(k in sid for k in ("/rollout", "/reference/", "/training/"))}
    for sid, (t0, t1) in tools.items():
        held = [d for d, (g0, g1) in device.items() if g0 < t1 - 1e-3 and g1 > t0 + 1e-3]
        assert not held, f"{sid} [{t0:.3f}, {t1:.3f}] overlaps device work {held}"
