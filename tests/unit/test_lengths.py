"""Response-length shapes, empirical replay and the newer workload fields (jigsaw/sim/lengths.py,
jigsaw/sim/workload.py): sample statistics against the specified distributions, bit-identical
streams for existing workloads, exact replay, and every validation error."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from jigsaw.sim import lengths as ln
from jigsaw.sim import workload as wl

pytestmark = pytest.mark.timeout(60)

BASE = tomllib.loads(Path(wl.shipped()["qwen3-4b-aime"]).read_text())
SEARCH = tomllib.loads(Path(wl.shipped()["qwen3-4b-search-r1"]).read_text())
EMPIRICAL = "qwen3-4b-longcot-empirical"


def _all_paths() -> dict[str, str]:
    """A source for every possible parameter, so shape tests are not about provenance."""
    out = {}
    for prefix, cls in [("", wl.WorkloadSpec), ("lengths.", ln.Lengths), ("turns.", wl.Turns), ("tool.", wl.Tool),
                        ("reward.", wl.Reward), ("dynamic_sampling.", wl.DynamicSampling),
                        ("lengths.lognormal_mixture.", ln.LognormalMixture),
                        ("lengths.gaussian_mixture.", ln.GaussianMixture), ("lengths.pareto.", ln.Pareto)]:
        out.update({prefix + f.name: "test" for f in dataclasses.fields(cls)})
    return out


def make(lengths: dict | None = None, *, base: dict = BASE, prov: bool = True, dirname: Path | None = None,
         **top) -> wl.WorkloadSpec:
    raw = {**base, "name": "t", **top}
    if lengths is not None:
        raw["lengths"] = lengths
    raw["provenance"] = {**base["provenance"], **(_all_paths() if prov else {})}
    return wl.from_dict(raw, name="t", base=dirname)


def totals(s: wl.StepSamples) -> np.ndarray:
    return np.array([int(t.sum()) for t in s.turn_tokens])


def draw(spec: wl.WorkloadSpec, seed: int = 0, **kw) -> np.ndarray:
    return totals(wl.sample_step(spec, np.random.default_rng(seed), **kw))


MIX = {"max_tokens": 16384, "shape": "lognormal_mixture",
       "lognormal_mixture": {"weights": [0.3, 0.7], "medians_tokens": [100, 5000], "sigmas": [0.2, 0.2]}}


# ---------------------------------------------------------------- existing workloads: same stream

def _old_sample_step(w, rng, prompt_scale=None):
    """jigsaw/sim/workload.py's sample_step before shapes existed (git 479c49f), verbatim but for
    the StepSamples construction: the reference the default path must reproduce bit for bit."""
    L = w.lengths
    n_prompts = w.prompts if prompt_scale is None else len(prompt_scale)
    if prompt_scale is None:
        prompt_scale = L.median_tokens * np.exp(rng.normal(0.0, L.prompt_sigma, n_prompts))
    scale = np.repeat(prompt_scale, w.group)
    n = len(scale)
    prompts = np.maximum(1, np.round(w.prompt_tokens * np.exp(rng.normal(0.0, w.prompt_sigma, n)))).astype(int)
    turns = rng.choice(len(w.turns.probs), size=n, p=np.asarray(w.turns.probs)) + 1
    turn_tokens, ctx, tool = [], [], []
    for i in range(n):
        drawn = np.minimum(L.max_tokens, scale[i] * np.exp(rng.normal(0.0, L.response_sigma, int(turns[i]))))
        turn_tokens.append(wl._within_cap(np.maximum(1, np.round(drawn)).astype(int), L.max_tokens))
        k = len(turn_tokens[-1])
        ctx.append(np.round(w.turns.context_tokens * np.exp(rng.normal(0.0, w.turns.context_sigma, k - 1)))
                   .astype(int))
        tool.append(w.tool.latency_s * np.exp(rng.normal(0.0, w.tool.latency_sigma, k - 1)) if w.tool.latency_s
                    else np.zeros(k - 1))
    return prompts, turn_tokens, ctx, tool, prompt_scale


def _same(new: wl.StepSamples, old: tuple) -> bool:
    prompts, turn_tokens, ctx, tool, scale = old
    return (np.array_equal(new.prompt_tokens, prompts) and np.array_equal(new.prompt_scale, scale)
            and all(np.array_equal(a, b) for a, b in zip(new.turn_tokens, turn_tokens, strict=True))
            and all(np.array_equal(a, b) for a, b in zip(new.context_tokens, ctx, strict=True))
            and all(np.array_equal(a, b) for a, b in zip(new.tool_s, tool, strict=True)))


# The shipped workloads the old sampler could describe (later ones use newer fields: classes,
# a tool tail, a cap on observations, a start step inside drift).
OLD_SAMPLER = ("deepseek-r1-distill-qwen-14b-math", "llama-3.1-8b-instruct-gsm8k", "qwen3-0.6b-gsm8k",
               "qwen3-0.6b-math", "qwen3-32b-math", "qwen3-4b-aime", "qwen3-4b-aime-multiturn", "qwen3-4b-gsm8k",
               "qwen3-4b-gsm8k-a100", "qwen3-4b-gsm8k-multiturn", "qwen3-4b-instruct-gsm8k", "qwen3-4b-search-r1")


def test_existing_workloads_sample_bit_identically_to_the_old_sampler():
    assert set(OLD_SAMPLER) <= set(wl.shipped())
    for name in OLD_SAMPLER:
        spec = wl.get(name)
        assert spec.lengths.legacy, name
        for seed in (0, 7):
            new_rng, old_rng = np.random.default_rng(seed), np.random.default_rng(seed)
            for kw in ({}, {"prompt_scale": np.array([50.0, 700.0, 4000.0])}):
                new = wl.sample_step(spec, new_rng, step=5, **kw)  # no drift: the step changes nothing
                assert _same(new, _old_sample_step(spec, old_rng, **kw)), (name, seed, kw)
                assert np.array_equal(new.reward_s, np.full(len(new.prompt_tokens), spec.reward_s_per_sample))
            # no extra draw anywhere (reward, jitter): the pipeline's stream continues as before
            assert new_rng.bit_generator.state == old_rng.bit_generator.state, name


def _digest(s: wl.StepSamples) -> str:
    h = hashlib.sha256()
    h.update(np.asarray(s.prompt_tokens, dtype=np.int64).tobytes())
    for arrs in (s.turn_tokens, s.context_tokens):
        for a in arrs:
            h.update(np.asarray(a, dtype=np.int64).tobytes() + b"|")
    for a in s.tool_s:
        h.update(np.round(np.asarray(a, dtype=float), 6).tobytes() + b"|")
    h.update(np.round(np.asarray(s.prompt_scale, dtype=float), 6).tobytes())
    return h.hexdigest()[:16]


# Produced with the sampler of git 479c49f (before shapes): for each (workload, seed), digest of
# sample_step(spec, rng) then of sample_step(spec, rng, prompt_scale=[100, 900, 3000]) on the same rng.
PINNED = {("qwen3-4b-gsm8k", 0): ("a7714a6b135e761c", "288b86b05b9cfe3f"),
          ("qwen3-4b-search-r1", 1): ("379f39e4d4adbf16", "5914e37c864b5494"),
          ("qwen3-4b-aime-multiturn", 2): ("73998294723f0185", "36a475af16b528a0"),
          ("deepseek-r1-distill-qwen-14b-math", 3): ("d62ccec3a3684409", "164a3c6946986e70")}


@pytest.mark.parametrize("name,seed", list(PINNED))
def test_existing_workloads_match_pinned_digests(name, seed):
    spec, rng = wl.get(name), np.random.default_rng(seed)
    a = wl.sample_step(spec, rng)
    b = wl.sample_step(spec, rng, prompt_scale=np.array([100.0, 900.0, 3000.0]))
    assert (_digest(a), _digest(b)) == PINNED[(name, seed)]


# ---------------------------------------------------------------- shapes

def test_lognormal_mixture_weights_and_medians_are_recovered():
    spec = make(MIX, prompts=2000, group=8)
    x = draw(spec)
    low, high = x[x < 700], x[x >= 700]
    assert abs(len(low) / len(x) - 0.3) < 0.015
    assert abs(np.median(low) / 100 - 1) < 0.03 and abs(np.median(high) / 5000 - 1) < 0.03
    assert abs(np.std(np.log(high)) - 0.2) < 0.02
    assert spec.lengths.median_tokens == pytest.approx(float(ln.body_quantile(spec.lengths, np.array([0.5]))[0]))


def test_gaussian_mixture_weights_means_and_stds_are_recovered():
    g = {"weights": [0.25, 0.75], "means_tokens": [500, 3000], "stds_tokens": [50, 200]}
    x = draw(make({"shape": "gaussian_mixture", "gaussian_mixture": g}, prompts=2000, group=8))
    low, high = x[x < 1500], x[x >= 1500]
    assert abs(len(low) / len(x) - 0.25) < 0.015
    assert abs(low.mean() - 500) < 5 and abs(high.mean() - 3000) < 15
    assert abs(low.std() - 50) < 4 and abs(high.std() - 200) < 10


def test_gaussian_mixture_is_clipped_at_one_token():
    g = {"weights": [1.0], "means_tokens": [0.0], "stds_tokens": [3.0]}
    x = draw(make({"shape": "gaussian_mixture", "gaussian_mixture": g}, prompts=500, group=8))
    assert x.min() == 1 and abs((x == 1).mean() - stats.norm.cdf(1.5, 0, 3)) < 0.03


def test_cap_spike_fraction():
    x = draw(make({**MIX, "cap_spike_frac": 0.1}, prompts=2000, group=8))
    assert abs((x == 16384).mean() - 0.1) < 0.01
    assert x.max() == 16384


def test_short_answer_fraction():
    x = draw(make({**MIX, "short_frac": 0.07, "short_tokens": 3}, prompts=2000, group=8))
    assert abs((x == 3).mean() - 0.07) < 0.008


def test_point_masses_on_the_default_shape_leave_its_body():
    lengths = {"median_tokens": 1000.0, "prompt_sigma": 0.0, "response_sigma": 0.3, "max_tokens": 8192,
               "cap_spike_frac": 0.2}
    x = draw(make(lengths, prompts=2000, group=8))
    assert abs((x == 8192).mean() - 0.2) < 0.012
    assert abs(np.median(x[x < 8192]) / 1000 - 1) < 0.03


def _hill(x: np.ndarray, k: int) -> float:
    top = np.sort(x)[::-1]
    return 1.0 / float(np.mean(np.log(top[:k] / top[k])))


def test_pareto_tail_index_is_recovered():
    spec = make({"shape": "pareto", "pareto": {"alpha": 1.5, "scale_tokens": 1000}, "max_tokens": 10**8},
                prompts=4000, group=8)
    x = draw(spec)
    assert x.min() >= 1000
    assert abs(_hill(x, 3200) - 1.5) < 0.1
    assert spec.lengths.median_tokens == pytest.approx(1000 * 2 ** (1 / 1.5), rel=1e-3)


def test_pareto_tail_component_weight_and_index():
    lengths = {"median_tokens": 300.0, "prompt_sigma": 0.0, "response_sigma": 0.1, "max_tokens": 10**8,
               "tail_frac": 0.05, "pareto": {"alpha": 2.0, "scale_tokens": 5000}}
    x = draw(make(lengths, prompts=4000, group=8))
    tail = x[x >= 5000]
    assert abs(len(tail) / len(x) - 0.05) < 0.006
    assert abs(_hill(tail, len(tail) // 2) - 2.0) < 0.25


def _spearman_within_prompts(lengths: dict) -> float:
    x = draw(make(lengths, prompts=8000, group=2)).reshape(-1, 2)
    return float(stats.spearmanr(x[:, 0], x[:, 1])[0])


def test_copula_gives_the_specified_rank_correlation_within_a_prompt():
    rho = 0.6
    got = _spearman_within_prompts({**MIX, "copula_rho": rho})
    assert abs(got - 6 / np.pi * np.arcsin(rho / 2)) < 0.03
    assert abs(_spearman_within_prompts(MIX)) < 0.04  # neither scheme: independent responses


def test_two_level_factor_correlates_a_prompts_responses_for_any_shape():
    assert _spearman_within_prompts({**MIX, "prompt_sigma": 1.0}) > 0.2


def test_drift_scales_the_median_by_the_compound_rate():
    for lengths in ({"median_tokens": 1000.0, "prompt_sigma": 0.3, "response_sigma": 0.5}, MIX):
        spec = make({**lengths, "drift_per_step": 0.02}, prompts=2000, group=8)
        m0, m9 = np.median(draw(spec, 0)), np.median(draw(spec, 1, step=9))
        assert abs(m9 / m0 / 1.02**9 - 1) < 0.04, lengths
        # step 0 is the undrifted distribution, draw for draw
        assert np.array_equal(draw(spec, 0), draw(make(lengths, prompts=2000, group=8), 0))


def test_step_jitter_is_a_lognormal_factor_per_call():
    spec = make({"median_tokens": 1000.0, "prompt_sigma": 0.0, "response_sigma": 0.05, "step_jitter_sigma": 0.3},
                prompts=16, group=4)
    rng = np.random.default_rng(0)
    logs = [np.log(np.median(totals(wl.sample_step(spec, rng, step=k)))) for k in range(80)]
    assert abs(np.std(logs) - 0.3) < 0.06 and abs(np.mean(logs) - np.log(1000)) < 0.1


def test_resampling_given_prompt_scales_keeps_their_size_for_every_shape():
    for lengths in (MIX, {**MIX, "copula_rho": 0.9}):
        spec = make(lengths, prompts=4, group=64)
        scale = ln.prompt_scales(spec.lengths, np.random.default_rng(0), 2000)
        assert np.all(scale > 0)
        small = draw(spec, prompt_scale=np.full(4, 150.0))
        big = draw(spec, prompt_scale=np.full(4, 6000.0))
        assert np.median(small) < np.median(big)


def test_prompt_scales_helper_is_the_pipelines_inline_draw_for_lognormal2():
    spec = wl.get("qwen3-4b-gsm8k")
    a = wl.prompt_scales(spec, np.random.default_rng(3), 9)
    L = spec.lengths
    assert np.array_equal(a, L.median_tokens * np.exp(np.random.default_rng(3).normal(0.0, L.prompt_sigma, 9)))


# ---------------------------------------------------------------- reward, tool, other fields

def test_reward_distribution_timeout_and_per_batch():
    spec = make(reward={"median_s": 2.0, "sigma": 0.5, "timeout_s": 3.0}, prompts=500, group=8)
    s = wl.sample_step(spec, np.random.default_rng(0))
    assert s.reward_s.shape == (4000,) and s.reward_s.max() == 3.0
    assert np.array_equal(s.reward_timed_out, s.reward_s == 3.0)
    assert abs(s.reward_timed_out.mean() - stats.norm.sf(np.log(1.5) / 0.5)) < 0.02
    assert abs(np.median(s.reward_s) - 2.0) < 0.1
    batch = wl.sample_step(make(reward={"median_s": 2.0, "per_batch": True}), np.random.default_rng(0))
    assert batch.reward_s.shape == (1,) and batch.reward_s[0] == 2.0 and not batch.reward_timed_out[0]


def test_tool_call_cap_and_timeout():
    spec = make(base=SEARCH, tool={**SEARCH["tool"], "max_calls": 2, "timeout_s": 0.6}, prompts=200)
    s = wl.sample_step(spec, np.random.default_rng(0))
    assert max(len(t) for t in s.turn_tokens) == 3
    calls = np.concatenate(s.tool_s)
    assert calls.max() == 0.6 and 0.3 < (calls == 0.6).mean() < 0.7  # median 0.55: about half are cut


def test_other_fields_are_stored():
    spec = make(trajectory_timeout_s=600.0, ppo_epochs=2, dynamic_sampling={"keep_frac": 0.6, "max_gen_batches": 3})
    assert (spec.trajectory_timeout_s, spec.ppo_epochs) == (600.0, 2)
    assert spec.dynamic_sampling == wl.DynamicSampling(keep_frac=0.6, max_gen_batches=3)


# ---------------------------------------------------------------- provenance

def test_new_fields_need_provenance_only_off_their_default():
    spec = make(prov=False, ppo_epochs=1, trajectory_timeout_s=0.0)
    assert "ppo_epochs" not in wl.parameter_paths(spec)
    with pytest.raises(ValueError, match=r"'t'.*no provenance for \['lengths.cap_spike_frac'\]"):
        make({**BASE["lengths"], "cap_spike_frac": 0.1}, prov=False)
    with pytest.raises(ValueError, match=r"no provenance for \['reward.median_s', 'reward.timeout_s'\]"):
        make(prov=False, reward={"median_s": 1.0, "timeout_s": 5.0})
    mix = make(MIX, prov=True)
    paths = set(wl.parameter_paths(mix))
    assert "lengths.median_tokens" not in paths and "lengths.response_sigma" not in paths  # derived / unused
    assert {"lengths.shape", "lengths.lognormal_mixture.weights", "lengths.max_tokens"} <= paths


def test_replace_keeps_a_derived_spec_valid():
    for spec in (make(MIX), wl.get(EMPIRICAL)):
        wide = dataclasses.replace(spec, group=spec.group * 2)  # what tail batching's widened round does
        assert wide.lengths == spec.lengths
        assert dataclasses.replace(spec.lengths) == spec.lengths


# ---------------------------------------------------------------- empirical replay

def test_shipped_empirical_example_replays_every_sample_exactly():
    spec = wl.get(EMPIRICAL)
    assert (spec.model, spec.device, spec.gpus, spec.prompts, spec.group) == ("qwen3-4b", "h100", 8, 64, 8)
    path = Path(spec.lengths.empirical)
    assert path.stat().st_size < 300_000
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    rng = np.random.default_rng(0)
    for k in range(12):  # 10 steps in the file, then it cycles
        want = [r for r in recs if r["step"] == k % 10]
        s = wl.sample_step(spec, rng, step=k)
        assert s.prompt_tokens.tolist() == [r["prompt_len"] for r in want]
        assert [t.tolist() for t in s.turn_tokens] == [[r["response_len"]] for r in want]
        assert np.allclose(s.prompt_scale, totals(s).reshape(64, 8).mean(axis=1))
    assert np.median([r["response_len"] for r in recs]) == spec.lengths.median_tokens


def test_shipped_example_is_what_the_generator_writes(tmp_path):
    script = Path(__file__).resolve().parents[2] / "bench" / "make_length_trace.py"
    mod_spec = importlib.util.spec_from_file_location("make_length_trace", script)
    mod = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(mod)
    rng = np.random.default_rng(0)
    lines = [json.dumps(r, separators=(",", ":")) for k in range(mod.STEPS) for r in mod.step_records(rng, k)]
    assert "\n".join(lines) + "\n" == Path(wl.get(EMPIRICAL).lengths.empirical).read_text()


def _trace(tmp_path: Path, lines: list, name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def _rec(step: int, p: int, r: int, **kw) -> dict:
    return {"step": step, "prompt_len": p, "response_len": r, **kw}


def test_replay_groups_by_prompt_id_and_keeps_turns(tmp_path):
    lines = [_rec(5, 10, 100, prompt_id="b"), _rec(5, 20, 200, prompt_id="a"), _rec(5, 11, 101, prompt_id="b"),
             {"step": 5, "prompt_len": 21, "turn_lens": [50, 150], "prompt_id": "a", "reward": 1.0},
             "", _rec(9, 1, 1, prompt_id=0), _rec(9, 2, 2, prompt_id=1), _rec(9, 3, 3, prompt_id=0),
             _rec(9, 4, 4, prompt_id=1)]
    _trace(tmp_path, lines)
    spec = make({"empirical": "t.jsonl", "max_tokens": 512}, prompts=2, group=2, dirname=tmp_path)
    s0 = wl.sample_step(spec, np.random.default_rng(0))
    assert s0.prompt_tokens.tolist() == [10, 11, 20, 21]
    assert [t.tolist() for t in s0.turn_tokens] == [[100], [101], [200], [50, 150]]
    assert s0.prompt_scale.tolist() == [100.5, 200.0] and len(s0.context_tokens[3]) == 1
    s1 = wl.sample_step(spec, np.random.default_rng(0), step=1)
    assert s1.prompt_tokens.tolist() == [1, 3, 2, 4]
    assert wl.sample_step(spec, np.random.default_rng(0), step=2).prompt_tokens.tolist() == [10, 11, 20, 21]


@pytest.mark.parametrize("lines,match", [
    ([_rec(0, 5, 10), '{"step": 0, "prompt_len": 5,', _rec(0, 5, 10)], r"t.jsonl:2: not valid JSON"),
    ([_rec(0, 5, 10), _rec(0, 5, 600)], r"t.jsonl:2: response_len 600 above lengths.max_tokens 512"),
    ([_rec(0, 5, 0), _rec(0, 5, 1)], r"t.jsonl:1: response_len must be an int >= 1, got 0"),
    ([_rec(0, -1, 3), _rec(0, 5, 1)], r"t.jsonl:1: prompt_len must be an int >= 1"),
    ([_rec(0, 5, 3), {"step": 0, "prompt_len": 5}], r"t.jsonl:2: missing 'response_len'"),
    ([_rec(0, 5, 3), _rec(0, 5, 2.5)], r"t.jsonl:2: response_len must be an int"),
    ([_rec(0, 5, 3), "[1, 2]"], r"t.jsonl:2: expected a JSON object"),
    ([_rec(0, 5, 3), _rec(0, 5, 9, turn_lens=[4, 4])], r"t.jsonl:2: response_len 9 != sum\(turn_lens\) 8"),
    ([_rec(0, 5, 3), _rec(0, 5, 3), _rec(1, 5, 3)], r"t.jsonl:3: step 1 has 1 samples.*2 × 1 = 2"),
    ([_rec(0, 5, 3, prompt_id=1), _rec(0, 5, 3)], r"t.jsonl:2: step 0 mixes lines with and without prompt_id"),
    ([_rec(0, 5, 3, prompt_id=1), _rec(0, 5, 3, prompt_id=1)], r"t.jsonl:1: step 0 has 1 prompt_ids \(want 2\)"),
    ([], r"t.jsonl: no records"),
])
def test_bad_traces_are_refused_naming_file_and_line(tmp_path, lines, match):
    _trace(tmp_path, lines)
    with pytest.raises(ValueError, match=r"workload 't'.*" + match):
        make({"empirical": "t.jsonl", "max_tokens": 512}, prompts=2, group=1, dirname=tmp_path)


def test_trace_errors_through_load_name_the_toml_and_the_trace(tmp_path):
    _trace(tmp_path, [_rec(0, 5, 10)] * 511 + [_rec(0, 5, 99999)], name="x.jsonl")
    text = Path(wl.shipped()[EMPIRICAL]).read_text().replace("qwen3-4b-longcot-empirical.jsonl", "x.jsonl")
    (tmp_path / "w.toml").write_text(text)
    with pytest.raises(ValueError, match=r"w.toml: workload 'qwen3-4b-longcot-empirical'.*x.jsonl:512: response_len"):
        wl.load(tmp_path / "w.toml")
    with pytest.raises(ValueError, match=r"cannot read"):
        make({"empirical": "missing.jsonl"}, dirname=tmp_path)


# ---------------------------------------------------------------- validation

LN2 = {"median_tokens": 1000.0, "prompt_sigma": 0.3, "response_sigma": 0.5}
BAD = [
    ({**MIX, "lognormal_mixture": {**MIX["lognormal_mixture"], "weights": [0.3, 0.6]}}, {},
     r"lengths.lognormal_mixture.weights must be non-negative and sum to 1"),
    ({**MIX, "lognormal_mixture": {**MIX["lognormal_mixture"], "sigmas": [0.2, -0.1]}}, {},
     r"lengths.lognormal_mixture.sigmas must be >= 0"),
    ({**MIX, "lognormal_mixture": {**MIX["lognormal_mixture"], "medians_tokens": [100]}}, {},
     r"lengths.lognormal_mixture.medians_tokens has 1 entries, weights 2"),
    ({**MIX, "lognormal_mixture": {**MIX["lognormal_mixture"], "medians_tokens": [0, 5]}}, {},
     r"lengths.lognormal_mixture.medians_tokens must be > 0"),
    ({"shape": "gaussian_mixture", "gaussian_mixture": {"weights": [1], "means_tokens": [5], "stds_tokens": [-1]}},
     {}, r"lengths.gaussian_mixture.stds_tokens must be >= 0"),
    ({"shape": "pareto", "pareto": {"alpha": 0, "scale_tokens": 10}}, {}, r"lengths.pareto.alpha must be > 0"),
    ({"shape": "pareto", "pareto": {"alpha": 1, "scale_tokens": -1}}, {}, r"lengths.pareto.scale_tokens must be > 0"),
    ({"shape": "weibull"}, {}, r"lengths.shape 'weibull' unknown"),
    ({"shape": "lognormal_mixture"}, {}, r"lengths.lognormal_mixture: .* \(missing\)"),
    ({**LN2, "lognormal_mixture": MIX["lognormal_mixture"]}, {}, r"lengths.lognormal_mixture: .*shape is 'lognormal2'"),
    ({**LN2, "pareto": {"alpha": 1, "scale_tokens": 10}}, {}, r"lengths.pareto: a \[lengths.pareto\] table goes"),
    ({**LN2, "tail_frac": 0.1}, {}, r"lengths.pareto: a \[lengths.pareto\] table goes"),
    ({"shape": "pareto", "pareto": {"alpha": 1, "scale_tokens": 10}, "tail_frac": 0.1}, {}, r"lengths.tail_frac"),
    ({**MIX, "response_sigma": 0.4}, {}, r"lengths.response_sigma is lognormal2's"),
    ({**MIX, "median_tokens": 123.0}, {}, r"lengths.median_tokens is derived"),
    ({**LN2, "median_tokens": 0.0}, {}, r"lengths.median_tokens must be > 0"),
    ({**LN2, "cap_spike_frac": 1.2}, {}, r"lengths.cap_spike_frac must be in \[0, 1\], got 1.2"),
    ({**LN2, "short_frac": -0.1}, {}, r"lengths.short_frac must be in \[0, 1\]"),
    ({**LN2, "short_frac": 0.1}, {}, r"lengths.short_tokens must be in \[1, max_tokens\]"),
    ({**LN2, "short_frac": 0.6, "short_tokens": 4, "cap_spike_frac": 0.4}, {},
     r"lengths.short_frac \+ cap_spike_frac must be < 1"),
    ({**LN2, "copula_rho": 1.5}, {}, r"lengths.copula_rho must be in \[0, 1\]"),
    ({**LN2, "copula_rho": 0.5}, {}, r"lengths.copula_rho and lengths.prompt_sigma"),
    ({**LN2, "drift_per_step": -1.0}, {}, r"lengths.drift_per_step must be > -1"),
    ({**LN2, "step_jitter_sigma": -0.1}, {}, r"lengths.step_jitter_sigma must be >= 0"),
    ({**LN2, "prompt_sigma": -0.1}, {}, r"lengths.prompt_sigma and response_sigma must be >= 0"),
    ({**LN2, "max_tokens": 0}, {}, r"lengths.max_tokens must be >= 1"),
    ({**LN2, "median_tokenz": 1.0}, {}, r"\[lengths\]: unknown key\(s\) \['median_tokenz'\]"),
    ({**MIX, "lognormal_mixture": {**MIX["lognormal_mixture"], "w": 1}}, {}, r"\[lengths.lognormal_mixture\]: unknown"),
    ({"empirical": "x.jsonl", "drift_per_step": 0.1}, {}, r"lengths.empirical replays .*remove \['drift_per_step'\]"),
    ({"empirical": "x.jsonl", "median_tokens": 5.0}, {}, r"lengths.median_tokens is derived from lengths.empirical"),
    (None, {"reward": {"median_s": 0.0}}, r"reward.median_s must be > 0"),
    (None, {"reward": {"median_s": 1.0, "sigma": -1}}, r"reward.sigma must be >= 0"),
    (None, {"reward": {"median_s": 1.0, "timeout_s": -1}}, r"reward.timeout_s must be >= 0"),
    (None, {"reward": {"median_s": 1.0, "tmeout_s": 1}}, r"\[reward\]: unknown key\(s\) \['tmeout_s'\]"),
    (None, {"tool": {**BASE["tool"], "max_calls": 2}}, r"tool.max_calls and tool.timeout_s need a tool"),
    (None, {"tool": {**SEARCH["tool"], "max_calls": -1}}, r"tool.max_calls must be an int >= 0"),
    (None, {"tool": {**SEARCH["tool"], "timeout_s": -1.0}}, r"tool.timeout_s must be >= 0"),
    (None, {"trajectory_timeout_s": -5.0}, r"trajectory_timeout_s must be >= 0"),
    (None, {"ppo_epochs": 0}, r"ppo_epochs must be an int >= 1"),
    (None, {"dynamic_sampling": {"keep_frac": 0.0, "max_gen_batches": 2}}, r"dynamic_sampling.keep_frac must be in"),
    (None, {"dynamic_sampling": {"keep_frac": 0.5, "max_gen_batches": 0}}, r"dynamic_sampling.max_gen_batches"),
    (None, {"epochs": 2}, r"top level: unknown key\(s\) \['epochs'\]"),
]


@pytest.mark.parametrize("lengths,top,match", BAD)
def test_every_validation_error_names_the_workload_and_the_field(tmp_path, lengths, top, match):
    if lengths is not None and "empirical" in lengths:
        _trace(tmp_path, [_rec(0, 5, 10)] * 256)
        lengths = {**lengths, "empirical": "t.jsonl"}
    with pytest.raises(ValueError, match=r"workload 't': " + match):
        make(lengths, dirname=tmp_path, **top)
