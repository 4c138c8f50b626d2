"""The grant's memory and stream reach the engines: the KV room follows the memory grant, and a
worker process follows the grant its client posts for it (mux/partition/board.py).

Preemption is by recomputation: a preempted request keeps its tokens and is prefilled again
from prompt + those tokens, so greedy outputs are token-identical to a run without a limit.
The stream half runs on a FAKE GPU (mux/partition/fake_gpu.py, named as such): its log says
which side and KV limit every forward of the worker ran under.
"""

import time

import pytest
from waiting import HANG_S, Hold, wait_until

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jigsaw.engines.dp import DPRollout
from jigsaw.engines.model import ModelConfig
from jigsaw.engines.rollout import Request, RolloutConfig, RolloutEngine, kv_bytes_per_token
from jigsaw.mux.partition import fake_gpu
from jigsaw.mux.partition.board import Posting, post, withdraw
from jigsaw.mux.partition.partitioners import Green
from jigsaw.mux.partition.smsplit import PARTITION_LEVELS

NEW_TOKENS = 40
PAGE = RolloutConfig().page_size


@pytest.fixture(scope="module")
def engine(model_and_tok):
    model, tok = model_and_tok
    with RolloutEngine(model, tok, RolloutConfig()) as eng:
        yield eng


def _collect(engine, out: dict, until) -> None:
    def done() -> bool:
        for c in engine.poll(0.2):
            assert c.rid not in out, f"{c.rid} returned twice"
            out[c.rid] = c
        return until(out)

    wait_until(done, HANG_S, "requests finishing")


@pytest.fixture(scope="module")
def unlimited(engine, prompts):
    """Every prompt without a KV limit: the outputs, and the most KV one forward held."""
    engine.set_kv_limit(None)
    engine.forward_steps()
    for rid, ids in prompts:
        engine.submit(Request(rid=rid, prompt_ids=ids, max_new_tokens=NEW_TOKENS))
    out: dict = {}
    _collect(engine, out, lambda o: len(o) == len(prompts))
    assert not engine.preempted
    return {rid: c.output_ids for rid, c in out.items()}, max(s.kv_tokens for s in engine.forward_steps())


@pytest.mark.timeout(180)
def test_a_shrinking_kv_limit_preempts_the_newest_and_every_request_ends_once_token_identical(
        engine, prompts, unlimited):
    reference, unlimited_peak_kv = unlimited
    engine.preempted.clear()
    engine.forward_steps()
    limit = 4 * PAGE
    with Hold(engine.model, forwards=6) as hold:  # every request a few tokens in, at any load
        for rid, ids in prompts:
            engine.submit(Request(rid=rid, prompt_ids=ids, max_new_tokens=NEW_TOKENS))
        hold.reached()
        engine.set_kv_limit(limit)
        shrunk_s, first = time.monotonic(), [rid for rid, _ in engine.preempted]
    out: dict = {}
    _collect(engine, out, lambda o: len(o) >= 2)
    grown_s = time.monotonic()
    engine.set_kv_limit(None)  # memory given back: what waits starts again
    _collect(engine, out, lambda o: len(o) == len(prompts))

    assert first == [rid for rid, _ in prompts][::-1][:len(first)] and first, \
        f"the shrink must preempt the newest requests first, preempted {first}"
    assert {c.rid for c in out.values()} == {rid for rid, _ in prompts}
    for rid, ids in prompts:
        assert out[rid].finished and out[rid].output_ids == reference[rid], f"{rid} differs from its unlimited run"
        kept = [n for r, n in engine.preempted if r == rid]
        assert all(n > 0 for n in kept), f"{rid} was restarted instead of resumed: kept {kept}"
        assert out[rid].prefilled_tokens == len(ids) * (1 + len(kept)) + sum(kept), \
            f"{rid}: a resume prefills prompt + the tokens it kept"
        assert out[rid].generated_tokens == len(out[rid].output_ids)
    limited = [s for s in engine.forward_steps() if shrunk_s < s.t_start_s and s.t_end_s < grown_s][2:]
    assert limited, "no forward ran under the limit"
    assert max(s.kv_tokens for s in limited) <= limit + PAGE < unlimited_peak_kv, \
        "the engine held more KV than its limit"


@pytest.mark.timeout(180)
def test_a_limit_below_one_request_runs_them_one_at_a_time(engine, prompts, unlimited):
    reference, _ = unlimited
    engine.set_kv_limit(0)
    engine.forward_steps()
    try:
        for rid, ids in prompts[:3]:
            engine.submit(Request(rid=rid, prompt_ids=ids, max_new_tokens=NEW_TOKENS))
        out: dict = {}
        _collect(engine, out, lambda o: len(o) == 3)
    finally:
        engine.set_kv_limit(None)
    assert all(out[rid].output_ids == reference[rid] for rid, _ in prompts[:3])
    assert max(s.num_decode_reqs + (s.num_prefill_tokens > 0) for s in engine.forward_steps()) == 1


@pytest.mark.timeout(180)
def test_abort_all_returns_waiting_and_running_requests_once_and_starts_none(engine, prompts):
    engine.set_kv_limit(0)  # one runs, the others wait: a migration takes both kinds
    try:
        with Hold(engine.model, forwards=3) as hold:
            for rid, ids in prompts[:4]:
                engine.submit(Request(rid=rid, prompt_ids=ids, max_new_tokens=NEW_TOKENS))
            hold.reached()
            out = engine.abort_all()
    finally:
        engine.set_kv_limit(None)
    assert sorted(c.rid for c in out) == sorted(rid for rid, _ in prompts[:4]) and engine.active() == []
    assert [c.finished for c in out] == [False] * 4 and sum(len(c.output_ids) > 0 for c in out) == 1
    assert engine.poll(0.3) == []


def test_a_memory_grant_is_turned_into_kv_tokens_beside_the_weights(engine):
    model = engine.model
    c = model.config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4  # K and V, float32
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert kv_bytes_per_token(model) == per_token
    assert engine.kv_tokens_for(weights + 10 * per_token + per_token // 2) == 10
    assert engine.kv_tokens_for(weights // 2) == 0
    assert engine.kv_tokens_for(0) is None


def _green(budget: float, side: int) -> Green:
    return Green(num_sms=_sm_ids(budget, side)[1] - _sm_ids(budget, side)[0], budget=budget, side=side,
                 levels=PARTITION_LEVELS)


def _sm_ids(budget: float, side: int) -> list[int]:
    """[first, last + 1) SM ids of that side on the fake device, as its log writes them."""
    s = fake_gpu.FakeGreenPartitions(PARTITION_LEVELS, fake_gpu.hopper(132)).pair(budget)[side].stream
    return [s.first_sm, s.first_sm + s.num_sms]


@pytest.mark.timeout(240)
def test_a_worker_runs_every_forward_on_the_grant_posted_for_it_and_sizes_its_kv_from_it(
        tmp_path, monkeypatch, model_and_tok, prompts):
    log = tmp_path / "launches.jsonl"
    monkeypatch.setenv(fake_gpu.ENV_SMS, "132")  # the spawned worker inherits the FAKE GPU
    monkeypatch.setenv(fake_gpu.ENV_LOG, str(log))
    board = tmp_path / "board"
    model, _ = model_and_tok
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_tokens = 3 * PAGE
    with DPRollout(ModelConfig(), RolloutConfig(threads=1), num_workers=1, board=board) as dp:
        pid = dp.pids[0]
        post(board, pid, Posting(partition=_green(0.75, 1), mem_bytes=weights + kv_tokens * kv_bytes_per_token(model)))
        first = dp.generate(prompts, NEW_TOKENS)
        status = dp.status(0)
        changed_s = time.monotonic()
        post(board, pid, Posting(partition=_green(0.25, 0)))
        second = dp.generate(prompts, NEW_TOKENS)
        withdraw(board, [pid])
        wait_until(lambda: dp.status(0)["kv_limit"] is None, HANG_S, "the withdrawn grant's limit lifted")
    assert status["kv_limit"] == kv_tokens and status["preempted"], "the memory grant did not limit the KV room"
    assert [c.output_ids for c in first] == [c.output_ids for c in second]
    launches = fake_gpu.read_log(log)
    before = [x for x in launches if x["t_s"] < changed_s]
    after = [x for x in launches if x["t_s"] > changed_s]
    assert before and after and {x["pid"] for x in launches} == {pid}
    assert {(tuple(x["sm_ids"]), x["kv_tokens"]) for x in before} == {(tuple(_sm_ids(0.75, 1)), kv_tokens)}
    assert {(tuple(x["sm_ids"]), x["kv_tokens"]) for x in after} == {(tuple(_sm_ids(0.25, 0)), None)}


def test_a_malformed_posting_is_refused_and_the_last_good_one_kept(tmp_path, monkeypatch):
    from jigsaw.mux.partition.board import Follower

    monkeypatch.setenv(fake_gpu.ENV_SMS, "132")
    board = tmp_path / "board"
    post(board, 4242, Posting(partition=_green(0.5, 1), mem_bytes=7))
    follower = Follower(board, 4242)
    side = follower.stream()
    assert follower.current().mem_bytes == 7 and [side.first_sm, side.first_sm + side.num_sms] == _sm_ids(0.5, 1)
    time.sleep(0.01)  # a new mtime
    (board / "4242").write_bytes(b'{"partition": {"kind": "exec", "code": "import os"}}')
    assert follower.current().mem_bytes == 7 and follower.stream() == side
    withdraw(board, [4242])
    assert follower.current() is None and follower.stream() is None


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_the_recipe_runs_its_engines_on_a_gpu():
    """The CB rollout worker and the FSDP trainer rank (NCCL) run the recipe's steps on the GPU."""
    from jigsaw.recipes.grpo import RecipeConfig, run

    doc = run(RecipeConfig(steps=2, prompts=2, group=2, max_new_tokens=16, long_tail=False, device="cuda",
                           name="gpu-engines"))
    assert len(doc["steps"]) == 2 and doc["fell_open"] == []
    assert all(s["tokens"] > 0 and s["loss"] == s["loss"] for s in doc["steps"])  # tokens made, loss not NaN
