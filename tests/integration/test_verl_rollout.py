"""The `jigsaw` rollout backend's replicas as verl drives them: Ray actors on a local cluster.

    two RolloutServer actors (jigsaw_rollout_0, _1), greedy, the tiny Qwen3 of the verl assets
    generate() × 6 on replica 0 ─► outputs A (unmigrated)
    generate() × 6 on replica 0, then migrate_to(1) mid-generation ─► outputs B
        B == A token for token; replica 1 prefilled prompt + partial and generated only the
        rest (a migration, not a restart); every request answered once
    abort_all_requests() ─► stop_reason "abort" with the partial tokens (verl's form)
"""

from __future__ import annotations

import pytest
from waiting import HANG_S, wait_until

pytest.importorskip("verl", reason="verl is not installed: pip install -c constraints.txt -e '.[dev,verl]'")
ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.verl, pytest.mark.timeout(300)]

NEW_TOKENS = 160
"""Long enough that a migration or an abort asked after a few forward steps lands mid-generation."""
TEXTS = ["Tom has 3 apples and buys 4 more.", "What is 12 - 5?", "Solve step by step: 2 * 6 + 1",
         "the answer is", "0 1 2 3 4 5", "add the numbers 7 and 9"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from jigsaw.integrations.verl.assets import make_model

    path = make_model(tmp_path_factory.mktemp("verl-model") / "model")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield path
    ray.shutdown()


@pytest.fixture(scope="module")
def prompts(model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return [tuple(tok.encode(t)) for t in TEXTS]


def start(model, n: int):
    from jigsaw.integrations.verl.server import RolloutServer, ServerConfig, server_name

    actors = [ray.remote(RolloutServer).options(name=server_name(r), num_cpus=0, max_concurrency=64).remote(
        ServerConfig(model_path=str(model), temperature=0.0, max_new_tokens=NEW_TOKENS, replica_rank=r, threads=1))
        for r in range(n)]
    ray.get([a.ready.remote() for a in actors], timeout=120)
    return actors


def named(name: str) -> bool:
    """Whether a live actor holds `name` (a killed one gives its name back once Ray has it dead)."""
    try:
        ray.get_actor(name)
    except ValueError:
        return False
    return True


def stop(actors) -> None:
    from jigsaw.integrations.verl.server import server_name

    for a in actors:
        ray.kill(a)
    names = [server_name(r) for r in range(len(actors))]  # the next test's replicas take them again
    wait_until(lambda: not any(named(n) for n in names), HANG_S, f"{names} free again")


def generate(server, prompts, rid: str):
    params = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": NEW_TOKENS, "logprobs": True}
    return [server.generate.remote(prompt_ids=list(p), sampling_params=params, request_id=f"{rid}-{i}")
            for i, p in enumerate(prompts)]


def after_forwards(actor, n: int, timeout_s: float = 60) -> None:
    """Return once `actor`'s engine has run `n` more forward steps."""
    start = ray.get(actor.migration_stats.remote(), timeout=30)["forwards"]
    wait_until(lambda: ray.get(actor.migration_stats.remote(), timeout=30)["forwards"] >= start + n, timeout_s,
               f"{n} more forward steps")


def test_a_migrated_greedy_rollout_is_token_identical_and_loses_nothing(model, prompts):
    actors = start(model, 2)
    try:
        plain = ray.get(generate(actors[0], prompts, "plain"), timeout=120)
        for _attempt in range(3):  # the move must land mid-generation; again if it came too late
            refs = generate(actors[0], prompts, "moved")
            after_forwards(actors[0], 4)
            moved = ray.get(actors[0].migrate_to.remote(1), timeout=60)
            out = ray.get(refs, timeout=120)
            if moved:
                break
        stats = ray.get([a.migration_stats.remote() for a in actors], timeout=30)
    finally:
        stop(actors)
    assert moved > 0, "no request was in flight when the migration was asked for"
    assert all(o.stop_reason == "completed" for o in plain + out)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]  # token for token
    for a, b in zip(plain, out):
        assert len(b.log_probs) == len(b.token_ids)
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs)) < 1e-3
    assert stats[0]["moved_out"] == moved
    resumed = stats[1]["resumed"]
    assert len(resumed) == moved and any(carried > 0 for _, carried, _, _ in resumed)
    by_rid = {f"moved-{i}": (len(p), o) for i, (p, o) in enumerate(zip(prompts, out))}
    for rid, carried, prefilled, generated in resumed:  # prompt + partial prefilled, only the rest generated
        prompt_len, o = by_rid[rid]
        assert prefilled == prompt_len + carried and generated == len(o.token_ids) - carried


def test_abort_returns_the_partial_output_in_verls_form(model, prompts):
    (actor,) = start(model, 1)
    try:
        plain = ray.get(generate(actor, prompts[:2], "whole"), timeout=120)
        refs = generate(actor, prompts[:2], "cut")
        after_forwards(actor, 4)
        ray.get(actor.abort_all_requests.remote(), timeout=60)
        out = ray.get(refs, timeout=60)
    finally:
        stop([actor])
    for whole, cut in zip(plain, out):
        if cut.stop_reason == "abort":
            assert whole.token_ids[:len(cut.token_ids)] == cut.token_ids and len(cut.token_ids) < NEW_TOKENS
        else:
            assert cut.token_ids == whole.token_ids  # it had finished before the abort
    assert any(c.stop_reason == "abort" for c in out)


def test_a_request_verl_cannot_be_served_is_refused_clearly(model, prompts):
    (actor,) = start(model, 1)
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="temperature"):
            ray.get(actor.generate.remote(prompt_ids=list(prompts[0]), request_id="hot",
                                          sampling_params={"temperature": 0.7, "max_new_tokens": 4}), timeout=60)
        ok = ray.get(generate(actor, prompts[:1], "after"), timeout=60)  # the replica serves on
    finally:
        stop([actor])
    assert ok[0].stop_reason == "completed" and ok[0].token_ids


def test_serving_answers_every_request_once_under_a_burst(model, prompts):
    (actor,) = start(model, 1)
    try:
        refs = [r for k in range(4) for r in generate(actor, prompts, f"burst{k}")]
        out = ray.get(refs, timeout=180)
    finally:
        stop([actor])
    assert len(out) == 4 * len(prompts) and all(o.stop_reason == "completed" for o in out)
    assert [o.token_ids for o in out[:len(prompts)]] == [o.token_ids for o in out[-len(prompts):]]
