"""Rollout engine on transformers' continuous batching, and DP rollout workers as processes.

Greedy CB output equals plain `model.generate` on the tiny Qwen3 (checked below), so the
migration acceptance test compares migrated runs against both.
"""

import itertools
import os

import psutil
import pytest
from waiting import HANG_S, Hold, wait_until

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jigsaw.engines.dp import DPRollout, WorkerError, split_by_weights
from jigsaw.engines.model import ModelConfig
from jigsaw.engines.rollout import Request, RolloutConfig, RolloutEngine

NEW_TOKENS = 48


@pytest.fixture(scope="module")
def reference(model_and_tok, prompts):
    """Plain HF greedy generate, one prompt at a time (no padding)."""
    model, tok = model_and_tok
    out = {}
    with torch.no_grad():
        for rid, ids in prompts:
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            out[rid] = tuple(gen[0, len(ids):].tolist())
    return out


@pytest.fixture(scope="module")
def engine(model_and_tok):
    model, tok = model_and_tok
    with RolloutEngine(model, tok, RolloutConfig()) as eng:
        yield eng


@pytest.fixture(scope="module")
def dp():
    with DPRollout(ModelConfig(), RolloutConfig(threads=1), num_workers=2) as d:
        yield d


def _run(engine, reqs, timeout_s=HANG_S):
    for r in reqs:
        engine.submit(r)
    out = {}

    def finished() -> bool:
        for c in engine.poll(0.5):
            assert c.rid not in out
            out[c.rid] = c
        return len(out) == len(reqs)

    wait_until(finished, timeout_s, f"{len(reqs)} request(s) finished")
    return out


def _gone(pids):
    return all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)


# ------------------------------------------------------------------ in-process engine


def test_engine_greedy_matches_generate_and_records_steps(engine, prompts, reference):
    engine.forward_steps()
    out = _run(engine, [Request(rid=rid, prompt_ids=ids, max_new_tokens=NEW_TOKENS) for rid, ids in prompts])
    for rid, _ in prompts:
        c = out[rid]
        assert c.finished and c.output_ids == reference[rid]
        assert len(c.logprobs) == len(c.output_ids) and all(lp <= 0 for lp in c.logprobs)
    steps = engine.forward_steps()
    assert len(steps) >= NEW_TOKENS and all(s.num_tokens > 0 for s in steps)
    assert steps[0].num_prefill_tokens > 0 and steps[0].num_tokens == steps[0].num_prefill_tokens + \
        steps[0].num_decode_reqs
    assert all(a.t_end_s <= b.t_start_s and a.t_start_s <= a.t_end_s for a, b in itertools.pairwise(steps))
    assert engine.forward_steps() == [] and engine.active() == []


def test_abort_gives_a_prefix_and_resubmission_completes_it(engine, prompts):
    rid, ids = prompts[1]
    full = _run(engine, [Request(rid="full", prompt_ids=ids, max_new_tokens=200)])["full"].output_ids
    with Hold(engine.model, forwards=5) as hold:  # a few tokens in, far from the 200 budget, at any load
        engine.submit(Request(rid=rid, prompt_ids=ids, max_new_tokens=200))
        hold.reached()
        part = engine.abort(rid)
    assert not part.finished and engine.active() == []
    assert 0 < len(part.output_ids) < len(full) and full[:len(part.output_ids)] == part.output_ids
    assert len(part.logprobs) == len(part.output_ids)
    with pytest.raises(KeyError):
        engine.abort(rid)
    resumed = _run(engine, [Request(rid=rid, prompt_ids=ids, max_new_tokens=200, partial_ids=part.output_ids,
                                    partial_logprobs=part.logprobs)])[rid]
    assert resumed.finished and resumed.output_ids == full and resumed.logprobs[:len(part.logprobs)] == part.logprobs
    # no logprobs given: recomputed with the same weights, so they agree closely
    again = _run(engine, [Request(rid="x", prompt_ids=ids, max_new_tokens=200, partial_ids=part.output_ids)])["x"]
    assert again.output_ids == full
    assert max(abs(a - b) for a, b in zip(again.logprobs, resumed.logprobs)) < 1e-4


def test_abort_after_finishing_returns_it_finished_once(engine, prompts):
    rid, ids = prompts[2]
    engine.submit(Request(rid=rid, prompt_ids=ids, max_new_tokens=4))

    def finished() -> bool:  # its last output taken in, never polled
        engine._drain(0.0)
        return not engine.active()

    wait_until(finished, HANG_S, f"{rid} finishing")
    c = engine.abort(rid)
    assert c.finished and len(c.output_ids) == 4
    assert engine.poll(0.2) == [] and engine.active() == []


def test_budget_already_spent_finishes_at_once(engine, prompts):
    rid, ids = prompts[0]
    c = _run(engine, [Request(rid=rid, prompt_ids=ids, max_new_tokens=2, partial_ids=(5, 6),
                              partial_logprobs=(-1.0, -2.0))])[rid]
    assert c.finished and c.output_ids == (5, 6) and c.logprobs == (-1.0, -2.0)


# ------------------------------------------------------------------ DP workers


def test_split_by_weights():
    assert split_by_weights(6, (1, 0)) == [0] * 6
    assert split_by_weights(6, (1, 1)) == [0, 0, 0, 1, 1, 1]
    assert split_by_weights(5, (1, 1)) == [0, 0, 0, 1, 1]
    assert split_by_weights(4, (0.2, 0.3, 0.5)) == [0, 1, 2, 2]
    with pytest.raises(ValueError):
        split_by_weights(3, (0, 0))


def test_migration_is_token_identical_and_loses_nothing(dp, prompts, reference):
    """ACCEPTANCE: 6 prompts x 48 greedy tokens, worker 0 -> 1 after a few forward steps."""
    plain = dp.generate(prompts, NEW_TOKENS, timeout_s=60)
    assert [c.rid for c in plain] == [rid for rid, _ in prompts]
    assert all(c.output_ids == reference[c.rid] for c in plain)
    for _attempt in range(3):  # the move must land mid-generation; retry if the host stalled us
        seen, moved = {0: 0, 1: 0}, []
        dp.moves.clear()

        def on_step(rank, step, seen=seen):
            seen[rank] += 1

        def on_poll(d, seen=seen, moved=moved):
            if not moved and seen[0] >= 3:
                moved.append(d.migrate(0, 1))

        migrated = dp.generate(prompts, NEW_TOKENS, on_step=on_step, on_poll=on_poll, timeout_s=60)
        if moved and moved[0] > 0 and any(n > 0 for *_, n in dp.moves):
            break
    assert moved[0] == 3  # worker 0 held half of the batch
    assert [c.rid for c in migrated] == [rid for rid, _ in prompts]
    for a, b in zip(plain, migrated):
        assert b.finished and b.output_ids == a.output_ids == reference[a.rid]
        assert len(b.logprobs) == len(b.output_ids)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    # A migration, not a restart: the target prefilled prompt + partial output and generated
    # only the rest (a restart would prefill the prompt alone and generate everything again).
    by_rid, prompt_of = {c.rid: c for c in migrated}, dict(prompts)
    carried = {rid: n for rid, src, dst, n in dp.moves if (src, dst) == (0, 1)}
    assert len(carried) == 3 and any(n > 0 for n in carried.values())
    for rid, n in carried.items():
        c = by_rid[rid]
        assert c.prefilled_tokens == len(prompt_of[rid]) + n
        assert c.generated_tokens == len(c.output_ids) - n
    for c in migrated:
        if c.rid not in carried:
            assert c.prefilled_tokens == len(prompt_of[c.rid]) and c.generated_tokens == len(c.output_ids)
    assert dp.pending() == {}


def test_a_lost_request_fails_generate_at_its_deadline_instead_of_hanging(dp, prompts):
    def drop(d):  # a broken migration: the requests leave the source and go nowhere
        if not d.moves:
            for c in d._rpc(0, "abort_all"):
                d.moves.append((c.rid, 0, -1, len(c.output_ids)))

    dp.moves.clear()
    with pytest.raises(WorkerError, match="did not finish in 3 s"):
        dp.generate(prompts, NEW_TOKENS, on_poll=drop, timeout_s=3)
    dp.moves.clear()
    assert len(dp.generate(prompts[:2], 4, timeout_s=60)) == 2  # the workers were reset and still serve


def test_steps_reach_on_step_and_routing_weights(dp, prompts):
    steps = {0: [], 1: []}
    out = dp.generate(prompts, 8, routing=(1, 0), on_step=lambda r, s: steps[r].append(s))
    assert len(out) == len(prompts) and not steps[1] and steps[0]
    assert steps[0][0].num_prefill_tokens == sum(len(ids) for _, ids in prompts)
    assert all(s.num_tokens > 0 for s in steps[0])
    budgets = [2, 3, 4, 5, 6, 7]
    out = dp.generate(prompts, budgets, routing=(0, 1))
    assert [len(c.output_ids) for c in out] == budgets


def test_the_workers_say_the_size_of_the_model_they_serve(dp, model_and_tok):
    """The recipe prices FLOPs with it and never loads the model itself."""
    model, _ = model_and_tok
    assert dp.num_params == sum(p.numel() for p in model.parameters()) > 0
    assert len(set(dp.pids)) == dp.num_workers


def test_update_weights_changes_outputs_and_keeps_serving(dp, prompts, model_and_tok):
    model, _ = model_and_tok
    before = dp.generate(prompts[:2], 16)
    gen = torch.Generator().manual_seed(1)
    noisy = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
    dp.update_weights(noisy)
    after = dp.generate(prompts[:2], 16)
    assert any(a.output_ids != b.output_ids for a, b in zip(before, after))
    dp.update_weights(model.state_dict())  # back to the original: same outputs again
    assert [c.output_ids for c in dp.generate(prompts[:2], 16)] == [c.output_ids for c in before]


def test_a_bound_worker_follows_its_cores(prompts):
    """Bound from outside (the client's bind), a worker's every thread is on the partition's
    cores and its generation threads follow at the next forward, both ways."""
    from jigsaw.mux.partition.bind import Binder, affinity
    from jigsaw.mux.partition.partitioners import Cpu

    cores = sorted(os.sched_getaffinity(0))
    binder = Binder()
    with DPRollout(ModelConfig(), RolloutConfig(), num_workers=1) as d:  # threads follow the cores
        pid = d.pids[0]
        binder.bind(Cpu(cores=tuple(cores[:1]), threads=1), [pid])
        assert set(affinity(pid).values()) == {tuple(cores[:1])} and len(affinity(pid)) >= 2  # CB thread too
        d.generate(prompts[:2], 4, timeout_s=60)
        assert d.status(0)["generation_num_threads"] == 1
        binder.bind(None, [pid])  # exclusive again
        d.generate(prompts[:2], 4, timeout_s=60)
        assert set(affinity(pid).values()) == {tuple(cores)}
        assert d.status(0)["generation_num_threads"] == len(cores)


def test_workers_are_gone_after_close(prompts):
    d = DPRollout(ModelConfig(), RolloutConfig(), num_workers=1)
    pids = list(d.pids)
    assert len(d.generate(prompts[:1], 4)) == 1
    d.close()
    d.close()  # idempotent
    assert _gone(pids)


def test_workers_are_gone_after_an_error(prompts):
    def boom(rank, step):
        raise ZeroDivisionError("boom")

    with pytest.raises(ZeroDivisionError, match="boom"), DPRollout(ModelConfig(), RolloutConfig(), num_workers=1) as d:
        pids = list(d.pids)
        with pytest.raises(WorkerError, match="not in this engine"):
            d._rpc(0, "abort", "nope")  # a failed command leaves the worker serving
        with pytest.raises(ValueError, match="routing weights"):
            d.generate(prompts[:2], 8, routing=(1, 1))
        d.generate(prompts[:2], 8, on_step=boom, timeout_s=60)
    assert _gone(pids)
