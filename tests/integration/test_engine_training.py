"""GRPO math, the FSDP2 trainer over gloo rank processes, and the rewards.

The trainer tests spawn real rank processes (2 CPU cores on CI: a few seconds of start-up each,
mostly imports), so they share as few trainers as the checks allow.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random

import pytest
from waiting import alive

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from jigsaw.engines.grpo import (
    Sample,
    collate,
    group_advantages,
    grpo_loss,
    token_logprobs,
)
from jigsaw.engines.model import ModelConfig, load
from jigsaw.engines.rewards import ReasoningGymTask, TargetTokenReward, extract_answer
from jigsaw.engines.training import TrainConfig, Trainer, _plan
from jigsaw.mux.partition.bind import Binder, affinity
from jigsaw.mux.partition.partitioners import Cpu


# ── grpo math ──────────────────────────────────────────────────────────────────────────────
def test_group_advantages_hand_computed():
    adv = group_advantages([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0], group_size=4, eps=0.0 + 1e-6)
    std = math.sqrt(0.1875)  # population std of [1, 0, 0, 0]
    assert adv[:4] == pytest.approx([0.75 / std, -0.25 / std, -0.25 / std, -0.25 / std], rel=1e-5)
    assert adv[4:] == [0.0] * 4  # equal rewards carry no signal
    assert group_advantages([3.0, 1.0], 2) == pytest.approx([1.0, -1.0], rel=1e-5)
    with pytest.raises(ValueError):
        group_advantages([1.0, 2.0, 3.0], 2)


def _loss(lp, old, ref, adv, mask=None, clip_eps=0.2, kl_coef=0.0, num_tokens=None):
    lp = torch.tensor([lp], requires_grad=True)
    mask = torch.ones_like(lp) if mask is None else torch.tensor([mask])
    loss, metrics = grpo_loss(lp, torch.tensor([old]), torch.tensor([ref]), torch.tensor([adv]), mask,
                              clip_eps=clip_eps, kl_coef=kl_coef, num_tokens=num_tokens)
    loss.backward()
    return loss, metrics, lp.grad[0].tolist()


def test_grpo_loss_on_policy_no_clip_and_zero_kl():
    lp = [math.log(0.3), math.log(0.6)]
    loss, metrics, grad = _loss(lp, old=lp, ref=lp, adv=2.0, kl_coef=0.5)
    assert float(loss.detach()) == pytest.approx(-2.0)  # ratio 1: -A per token, token mean
    assert metrics["kl"] == 0.0 and metrics["clip_frac"] == 0.0
    assert grad == pytest.approx([-1.0, -1.0])  # d(-ρA)/dlp = -ρA / tokens


def test_grpo_loss_clipping_active_and_inactive():
    # A > 0: ρ = 1.5 is clipped to 1.2 (no gradient), ρ = 1.1 is inside the band
    loss, metrics, grad = _loss([math.log(1.5), math.log(1.1)], old=[0.0, 0.0], ref=[0.0, 0.0], adv=1.0)
    assert float(loss.detach()) == pytest.approx(-(1.2 + 1.1) / 2)
    assert metrics["clip_frac"] == pytest.approx(0.5)
    assert grad == pytest.approx([0.0, -1.1 / 2])
    # A < 0: ρ = 0.5 is clipped up to 0.8; ρ = 1.5 is not (the pessimistic unclipped term wins)
    loss, metrics, grad = _loss([math.log(0.5), math.log(1.5)], old=[0.0, 0.0], ref=[0.0, 0.0], adv=-1.0)
    assert float(loss.detach()) == pytest.approx((0.8 + 1.5) / 2)
    assert metrics["clip_frac"] == pytest.approx(0.5)
    assert grad == pytest.approx([0.0, 1.5 / 2])


def test_grpo_loss_k3_kl_mask_and_divisor():
    # policy p = 0.5 on a token the reference gives p = 1: k3 = 2 - ln 2 - 1
    lp = [math.log(0.5), math.log(0.5), 0.0]
    loss, metrics, _ = _loss(lp, old=lp, ref=[0.0, 0.0, 123.0], adv=0.0, mask=[1.0, 1.0, 0.0], kl_coef=0.1)
    k3 = 1.0 - math.log(2.0)
    assert metrics["kl"] == pytest.approx(k3)  # the masked third token (huge gap) is ignored
    assert float(loss.detach()) == pytest.approx(0.1 * k3)
    lp_t = torch.tensor([lp], requires_grad=True)
    loss, _ = grpo_loss(lp_t, lp_t.detach(), torch.tensor([[0.0, 0.0, 1e4]]), torch.tensor([1.0]),
                        torch.tensor([[1.0, 1.0, 0.0]]), clip_eps=0.2, kl_coef=0.1)
    loss.backward()
    assert torch.isfinite(lp_t.grad).all()  # junk in a padded column must not poison the gradient
    _, metrics, _ = _loss(lp, old=lp, ref=[0.0, 0.0, 123.0], adv=0.0, mask=[1.0, 1.0, 0.0], num_tokens=8)
    assert metrics["kl"] == pytest.approx(2 * k3 / 8)  # a share of a bigger batch's mean


def test_collate_layout_and_padding_invariant_logprobs():
    model, tok = load(ModelConfig())
    a = Sample(prompt_ids=(5, 6, 7), output_ids=(8, 9), reward=1.0)
    b = Sample(prompt_ids=(10,), output_ids=(11, 12, 13, 14), reward=0.0, old_logprobs=None)
    batch = collate([a, b], pad_id=tok.pad_token_id)
    assert int(batch["num_prompt_tokens"]) == 3
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 1], [1, 1, 10, 11, 12, 13, 14]]
    assert batch["response_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["position_ids"][1].tolist() == [0, 0, 0, 1, 2, 3, 4]
    with torch.no_grad():
        both = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["num_prompt_tokens"])
        alone = collate([a], pad_id=tok.pad_token_id)
        one = token_logprobs(model, alone["input_ids"], alone["attention_mask"], alone["num_prompt_tokens"])
        logits = model(input_ids=torch.tensor([[5, 6, 7, 8, 9]])).logits.log_softmax(-1)
    assert both.shape == (2, 4)
    torch.testing.assert_close(both[0, :2], one[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(one[0], torch.stack([logits[0, 2, 8], logits[0, 3, 9]]), rtol=0, atol=1e-5)


def test_plan_gives_every_rank_the_same_number_of_micro_batches():
    assert _plan(9, 2, 2) == [[[0, 1], [2, 3], [4]], [[5, 6], [7, 8], []]]
    assert _plan(3, 1, 8) == [[[0, 1, 2]]]
    assert _plan(1, 2, 4) == [[[0]], [[]]]
    # a gang's grants skew the shares towards the faster rank; the slower one runs empty ones
    assert _plan(9, 2, 2, (7, 2)) == [[[0, 1], [2, 3], [4, 5], [6]], [[7, 8], [], [], []]]
    for bad in ((5, 5), (9,), (10, -1)):
        with pytest.raises(ValueError, match="do not split"):
            _plan(9, 2, 2, bad)


# ── trainer ───────────────────────────────────────────────────────────────────────────────
def _batch(seed: int, n: int) -> list[Sample]:
    rng = random.Random(seed)
    return [Sample(prompt_ids=tuple(rng.randrange(2, 300) for _ in range(rng.randrange(1, 7))),
                   output_ids=tuple(rng.randrange(2, 300) for _ in range(rng.randrange(1, 9))),
                   reward=float(rng.random() < 0.5)) for _ in range(n)]


def _run_two_steps(world_size: int, samples: list[Sample], shares: tuple[int, ...] | None = None) -> dict:
    config = TrainConfig(world_size=world_size, micro_batch=2, lr=1e-3)
    with Trainer(ModelConfig(), config) as trainer:
        before = trainer.state_dict()
        ref = trainer.reference_logprobs(samples, shares)
        old = trainer.old_logprobs(samples)
        first = trainer.train_step(samples, ref, group_size=3, shares=shares)
        # stale old log-probs in the second step: ratios leave 1 and the clip can bite
        stale = [Sample(prompt_ids=s.prompt_ids, output_ids=s.output_ids, reward=s.reward, old_logprobs=o)
                 for s, o in zip(samples, old)]
        second = trainer.train_step(stale, ref, group_size=3, shares=shares)
        rank_samples = trainer.rank_samples
        after = trainer.state_dict()
        if world_size == 2:  # bound from outside (the client's bind), the ranks follow with their threads
            Binder().bind(Cpu(cores=(0,), threads=1), trainer.pids())
            for pid in trainer.pids():
                assert set(affinity(pid).values()) == {(0,)}
            trainer.reference_logprobs(samples[:2])  # still works on one core
        pids = trainer.pids()
    assert all(not alive(pid) for pid in pids)
    return {"before": before, "ref": ref, "old": old, "first": first, "second": second, "after": after,
            "rank_samples": rank_samples}


@pytest.mark.parametrize("shares", [None, (7, 2)], ids=["even", "skewed"])
def test_acceptance_two_gloo_ranks_match_one_rank(shares):
    """ACCEPTANCE: FSDP2 over 2 gloo ranks = 1 rank on the same batch (loss and new weights),
    split evenly or skewed as a gang's grants size the ranks' shares."""
    samples = _batch(seed=1, n=9)  # 2 ranks get 5 + 4: rank 1 runs an empty micro-batch
    one, two = _run_two_steps(1, samples), _run_two_steps(2, samples, shares)
    assert two["rank_samples"] == list(shares or (5, 4)) and one["rank_samples"] == [9]
    initial = load(ModelConfig())[0].state_dict()
    for name, tensor in one["before"].items():  # a snapshot: later steps did not change it
        torch.testing.assert_close(tensor, initial[name], rtol=0, atol=0)
    for step in ("first", "second"):
        assert two[step]["loss"] == pytest.approx(one[step]["loss"], rel=1e-4, abs=1e-7)
        assert two[step]["kl"] == pytest.approx(one[step]["kl"], rel=1e-4, abs=1e-7)
        assert two[step]["grad_norm"] == pytest.approx(one[step]["grad_norm"], rel=1e-4)
        assert two[step]["tokens"] == one[step]["tokens"] == sum(len(s.output_ids) for s in samples)
    assert one["first"]["kl"] == 0.0 and one["second"]["kl"] > 0.0
    for rows_1, rows_2 in zip(one["ref"] + one["old"], two["ref"] + two["old"]):
        assert rows_2 == pytest.approx(rows_1, abs=1e-5)
    assert one["after"].keys() == two["after"].keys() == initial.keys()
    for name, tensor in one["after"].items():
        assert not torch.equal(tensor, initial[name])
        # Adam normalises every element's step, so float-level gradient differences on elements
        # with ~0 gradient grow to a fraction of lr (1e-3): measured max 7e-6 after two steps
        torch.testing.assert_close(two["after"][name], tensor, rtol=1e-4, atol=5e-5)


def test_a_checkpoint_of_two_ranks_loads_into_one_and_trains_on_as_if_never_stopped(tmp_path):
    """save() then load() into another world size (a pipeline re-placed): the weights come back
    exactly, and the optimizer's state with them: the next step lands where the unstopped run's
    did (AdamW restarted from zero moments would not: its first step moves every weight by ~lr)."""
    batches = [_batch(seed=s, n=6) for s in (2, 3, 4)]
    config = TrainConfig(micro_batch=2, lr=1e-3)
    with Trainer(ModelConfig(), dataclasses.replace(config, world_size=2)) as trainer:
        for samples in batches[:2]:
            trainer.train_step(samples, None, group_size=3)
        trainer.save(tmp_path / "ckpt")
        saved = trainer.state_dict()
        trainer.train_step(batches[2], None, group_size=3)
        unstopped = trainer.state_dict()
    with Trainer(ModelConfig(), dataclasses.replace(config, world_size=1)) as trainer:
        with pytest.raises(FileNotFoundError, match="not a trainer checkpoint"):
            trainer.load(tmp_path)
        trainer.load(tmp_path / "ckpt")
        for name, tensor in trainer.state_dict().items():
            torch.testing.assert_close(tensor, saved[name], rtol=0, atol=0)
        trainer.train_step(batches[2], None, group_size=3)
        resumed = trainer.state_dict()
    for name, tensor in unstopped.items():
        assert not torch.equal(tensor, saved[name])
        torch.testing.assert_close(resumed[name], tensor, rtol=1e-4, atol=5e-5)  # as two ranks vs one, above


def test_rank_error_reaches_parent_and_leaves_no_processes():
    samples = _batch(seed=2, n=4)
    bad = Sample(prompt_ids=(5,), output_ids=(10**6,), reward=1.0)  # out of the vocabulary
    trainer = Trainer(ModelConfig(), TrainConfig(world_size=2, micro_batch=4))
    pids = trainer.pids()
    with pytest.raises(RuntimeError, match=r"rank 1 train:[\s\S]*index out of range"):
        trainer.train_step(samples[:3] + [bad], None, group_size=2)  # only rank 1 sees it
    assert all(not alive(pid) for pid in pids)  # rank 0 was stuck in a collective: killed
    with pytest.raises(RuntimeError, match="closed"):
        trainer.state_dict()
    trainer.close()  # idempotent


PROMPTS = ["Question: what is 3 + 4?", "the a an is", "Solve step by step.", "0 1 2 3",
           "<think> add", "12 - 5 =", "The answer is", "of to and in"]


@pytest.mark.timeout(900)  # a hang detector: 160 s on an idle 2-core machine, past the suite's 300 s with a core busy
def test_acceptance_grpo_learns_to_emit_a_target_token():
    """ACCEPTANCE (learning): reward = share of a target token; 24 GRPO steps raise it clearly."""
    torch.manual_seed(0)
    policy, tok = load(ModelConfig())
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():  # the token the random model already likes most: a non-zero start
        probs = policy(**enc).logits[:, -1].softmax(-1).mean(0)
    probs[[tok.eos_token_id, tok.pad_token_id]] = 0.0
    reward = TargetTokenReward(int(probs.argmax()))
    group, curve = 4, []
    config = TrainConfig(world_size=1, lr=1e-2, kl_coef=0.02, micro_batch=32, seed=0)
    with Trainer(ModelConfig(), config) as trainer:
        for _ in range(24):
            samples = _sample(policy, tok, enc, group, reward)
            curve.append(trainer.train_step(samples, None, group_size=group)["reward_mean"])
            policy.load_state_dict(trainer.state_dict())
    print("reward curve:", " ".join(f"{r:.2f}" for r in curve))
    start, end = sum(curve[:3]) / 3, sum(curve[-5:]) / 5
    assert end > start + 0.3, curve


def _sample(policy, tok, enc, group: int, reward: TargetTokenReward) -> list[Sample]:
    with torch.no_grad():  # 8 new tokens, eos suppressed so every output has the same length
        out = policy.generate(**enc, do_sample=True, top_k=0, max_new_tokens=8, min_new_tokens=8,
                              num_return_sequences=group, pad_token_id=tok.pad_token_id)
    width = enc.input_ids.shape[1]
    samples = []
    for i in range(out.shape[0]):
        prompt = enc.input_ids[i // group][enc.attention_mask[i // group].bool()].tolist()
        output = out[i, width:].tolist()
        samples.append(Sample(prompt_ids=tuple(prompt), output_ids=tuple(output), reward=reward.reward(output)))
    return samples


# ── rewards ───────────────────────────────────────────────────────────────────────────────
def test_reasoning_gym_prompts_reproducible_per_seed_and_step():
    pytest.importorskip("reasoning_gym")
    task, again = ReasoningGymTask(size=50, seed=3), ReasoningGymTask(size=50, seed=3)
    first = task.prompts(4, step=2)
    assert first == again.prompts(4, step=2)
    assert [p for p, _ in first] != [p for p, _ in task.prompts(4, step=3)]
    assert [p for p, _ in first] != [p for p, _ in ReasoningGymTask(size=50, seed=4).prompts(4, step=2)]
    assert all("Answer:" in p for p, _ in first)


@pytest.mark.parametrize("name", ["basic_arithmetic", "gsm_symbolic"])
def test_reasoning_gym_reward_scores_right_and_wrong_answers(name):
    pytest.importorskip("reasoning_gym")
    task = ReasoningGymTask(name, size=10, seed=0)
    _, item = task.prompts(1, step=0)[0]
    right = item["answer"]
    assert task.reward(f"Let me think. 2 + 2 = 4.\nAnswer: {right}", item) == 1.0
    assert task.reward(f"so the total is {right}", item) == 1.0
    assert task.reward(f"Answer: {int(float(right)) + 1}", item) < 1.0
    assert task.reward("no idea", item) == 0.0


def test_extract_answer_and_target_token_reward():
    assert extract_answer("3 + 4 = 7. Answer: -1,234 dollars\nbye 9") == "-1234"
    assert extract_answer("first 3 then 4.5") == "4.5"
    assert extract_answer("nothing") is None
    assert TargetTokenReward(7).reward([7, 1, 7, 2]) == 0.5
    assert TargetTokenReward(7).reward([]) == 0.0


@pytest.mark.timeout(120)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to shrink from")
def test_threads_follow_the_cores_at_every_layer_forward_and_backward():
    """A budget that shrinks or grows while one long command runs reaches torch's thread count
    at the next layer, not at the next command (two threads on one core spin on each other)."""
    import torch

    from jigsaw.engines.training import follow_threads_per_layer

    model, _ = load(ModelConfig())
    follow_threads_per_layer([model], cap=None)
    cores = sorted(os.sched_getaffinity(0))
    seen: list[tuple[str, int]] = []
    layers = model.model.layers
    layers[-1].register_forward_pre_hook(lambda *_: seen.append(("forward", torch.get_num_threads())))
    layers[0].register_full_backward_pre_hook(lambda *_: seen.append(("backward", torch.get_num_threads())))
    layers[0].register_forward_hook(lambda *_: os.sched_setaffinity(0, cores[:1]))  # shrinks mid-forward
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(len(cores))
        loss = model(torch.tensor([[1, 2, 3, 4]])).logits.sum()
        os.sched_setaffinity(0, cores)  # grows again before the backward
        loss.backward()
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(before)
    assert seen[0] == ("forward", 1) and seen[-1] == ("backward", len(cores))
