"""Response lengths of a workload: the `[lengths]` table of its TOML.

    [lengths] ──► Lengths (validated; derived median) ──┬─ empirical = "x.jsonl" ─► load_trace ─► Trace
                                                        │     replay(trace, step, prompts, group): the
                                                        │     file's exact lengths of that step
                                                        ├─ shape (+ tail_frac Pareto) ─► body quantile Q
                                                        └─ classes: per prompt a class, its own
                                                           two-level lognormal (class_scales, class_turns)
    per prompt: prompt_scale (tokens) ── two-level: factor = prompt_scale / median_tokens
                                     └─ copula:    latent z_p = Φ⁻¹(F(prompt_scale))
    per turn:   u ~ U(0,1) (two-level) or Φ(√ρ z_p + √(1-ρ) e) (copula)
                u < short_frac ─► short_tokens;  u ≥ 1 - cap_spike_frac ─► max_tokens;
                else Q(u') × factor × step_factor (drift, jitter) ─► clip at the cap ─► round, >= 1

The default shape, "lognormal2" without point masses, tail or copula (drift and jitter only scale
it), is not drawn here: workload.sample_step keeps its original per-sample draws so that existing
workloads give bit-identical samples.  Every other combination goes through `draw_turns`, one
vectorised call per step.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SHAPES = ("lognormal2", "lognormal_mixture", "gaussian_mixture", "pareto")
LEGACY_FIELDS = ("median_tokens", "prompt_sigma", "response_sigma", "max_tokens")
"""Fields that existed before shapes: they always need a provenance entry unless `derived_fields` says
the shape derives them or does not use them."""
_TINY = 1e-9  # a zero spread is a point mass; scipy needs a positive scale


@dataclass(frozen=True, kw_only=True, slots=True)
class LognormalMixture:
    """Body = Σ weights[k] · LogNormal(median = medians_tokens[k], log-space spread = sigmas[k])."""

    weights: tuple[float, ...]
    """Mixture weights, non-negative, summing to 1."""
    medians_tokens: tuple[float, ...]
    """Median of each component, tokens (> 0)."""
    sigmas: tuple[float, ...]
    """Log-space spread of each component (>= 0; 0 is a point mass at the median)."""

    def __post_init__(self) -> None:
        _check_mixture("lengths.lognormal_mixture", self.weights, medians_tokens=self.medians_tokens,
                       sigmas=self.sigmas)
        _need(all(m > 0 for m in self.medians_tokens), "lengths.lognormal_mixture.medians_tokens must be > 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class GaussianMixture:
    """Body = Σ weights[k] · Normal(means_tokens[k], stds_tokens[k]); draws below 1 token become 1."""

    weights: tuple[float, ...]
    """Mixture weights, non-negative, summing to 1."""
    means_tokens: tuple[float, ...]
    """Mean of each component, tokens."""
    stds_tokens: tuple[float, ...]
    """Standard deviation of each component, tokens (>= 0)."""

    def __post_init__(self) -> None:
        _check_mixture("lengths.gaussian_mixture", self.weights, means_tokens=self.means_tokens,
                       stds_tokens=self.stds_tokens)


@dataclass(frozen=True, kw_only=True, slots=True)
class Pareto:
    """Pareto (type I): P(X > x) = (scale_tokens / x)^alpha for x >= scale_tokens."""

    alpha: float
    """Tail index (> 0): the smaller, the heavier the tail (infinite mean at <= 1)."""
    scale_tokens: float
    """Minimum length of the component, tokens (> 0)."""

    def __post_init__(self) -> None:
        _need(self.alpha > 0, f"lengths.pareto.alpha must be > 0, got {self.alpha}")
        _need(self.scale_tokens > 0, f"lengths.pareto.scale_tokens must be > 0, got {self.scale_tokens}")


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptClass:
    """[[lengths.classes]]: one class of prompts (short factual questions, long proofs, ...) with
    its own two-level lognormal: each prompt of the class draws a difficulty scale around the
    class's median, each of its responses a length around that scale."""

    weight: float
    """Share of the step's prompts in the class (the weights of all classes sum to 1)."""
    median_tokens: float
    """Median response of the class, tokens (> 0)."""
    prompt_sigma: float = 0.0
    """Log-space spread of the class's prompt difficulty (scales) around its median."""
    response_sigma: float = 0.0
    """Log-space spread of one prompt's responses around its scale: the class's within-prompt
    spread."""

    def __post_init__(self) -> None:
        _need(self.weight >= 0, f"lengths.classes: weight must be >= 0, got {self.weight}")
        _need(self.median_tokens > 0, f"lengths.classes: median_tokens must be > 0, got {self.median_tokens}")
        _need(self.prompt_sigma >= 0 and self.response_sigma >= 0,
              f"lengths.classes: prompt_sigma and response_sigma must be >= 0, got {self.prompt_sigma}, "
              f"{self.response_sigma}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Lengths:
    """Generated tokens of one turn of one response."""

    median_tokens: float = 0.0
    """lognormal2: median over all responses (required).  Other shapes: the body's median, derived
    (leave it out); empirical: the median recorded response, derived.  The pipeline sizes KV pools
    from it and prompt_scale is relative to it."""
    prompt_sigma: float = 0.0
    """Log-space spread of the per-prompt difficulty factor (two-level correlation, any shape).
    Empirical: log-spread of the per-prompt mean lengths, derived on load."""
    response_sigma: float = 0.0
    """lognormal2: log-space spread of one prompt's responses around its scale.  Empirical: pooled
    within-prompt log-spread, derived on load (re-sampling deferred prompts uses it)."""
    max_tokens: int = 8192
    """Generation cap per response (JigsawRL §5.1: 8192)."""
    shape: str = "lognormal2"
    """Body of the distribution: one of SHAPES; the non-default ones read their own sub-table."""
    lognormal_mixture: LognormalMixture | None = None
    """[lengths.lognormal_mixture] when shape = "lognormal_mixture"."""
    gaussian_mixture: GaussianMixture | None = None
    """[lengths.gaussian_mixture] when shape = "gaussian_mixture"."""
    pareto: Pareto | None = None
    """[lengths.pareto] when shape = "pareto", or the tail component when tail_frac > 0."""
    tail_frac: float = 0.0
    """Weight of the Pareto tail mixed into a non-Pareto body, in [0, 1)."""
    short_frac: float = 0.0
    """Point mass: fraction of turns that are a very short answer of exactly short_tokens."""
    short_tokens: int = 0
    """Length of those short answers, tokens (>= 1 when short_frac > 0)."""
    cap_spike_frac: float = 0.0
    """Point mass: fraction of turns that hit max_tokens exactly, on top of the body's own clipped
    tail (multi-turn: a turn at the cap ends the response, the cap bounds the total)."""
    copula_rho: float = 0.0
    """> 0: Gaussian copula, correlation rho in (0, 1] between the latent normals of one prompt's
    responses, in place of the two-level factor (prompt_sigma must then be 0).  Spearman's rank
    correlation of the lengths is (6/π)·asin(rho/2) when there are no point masses."""
    drift_per_step: float = 0.0
    """Body lengths scale by (1 + drift_per_step)^step (RL responses grow during training); > -1."""
    step_jitter_sigma: float = 0.0
    """Body lengths scale by exp(N(0, step_jitter_sigma)), one draw per sample_step call."""
    empirical: str = ""
    """JSONL file replayed exactly (see load_trace); excludes every shape option above."""
    classes: tuple[PromptClass, ...] = ()
    """[[lengths.classes]]: prompts of several classes, each with its own median and spreads (in
    place of median_tokens, prompt_sigma and response_sigma, which are then derived or unused);
    goes with the default shape, its cap, drift and jitter only."""
    cap_counts_observations: bool = False
    """max_tokens bounds the generated tokens plus the observations appended between turns
    (turns.context_tokens: tool output), as an agent loop's response length does; a trajectory
    ends where the total reaches it.  False: the cap bounds the generated tokens only."""

    def __post_init__(self) -> None:
        _check_scalars(self)
        _check_shape(self)
        if self.empirical:
            _check_empirical(self)
            _derive(self, "median_tokens", load_trace(self.empirical, self.max_tokens).median_tokens)
        elif self.classes:
            _check_classes(self)
            _derive(self, "median_tokens", float(np.interp(0.5, *_grid(_classes_key(self))[::-1])))
        elif self.shape != "lognormal2":
            # lengths are at least one token, so a Gaussian body's median is too
            _derive(self, "median_tokens", max(1.0, float(body_quantile(self, np.array([0.5]))[0])))

    @property
    def legacy(self) -> bool:
        """Sampled by workload.sample_step's original lognormal code (bit-identical streams)."""
        return (self.shape == "lognormal2" and not self.empirical and self.copula_rho == 0 and not self.classes
                and self.short_frac == 0 and self.cap_spike_frac == 0 and self.tail_frac == 0)


def derived_fields(L: Lengths) -> set[str]:
    """Legacy fields this Lengths derives or ignores, so they need no provenance of their own."""
    out = set()
    if L.empirical or L.shape != "lognormal2" or L.classes:
        out |= {"median_tokens", "response_sigma"}
    if L.empirical or L.copula_rho > 0 or L.classes:
        out.add("prompt_sigma")
    return out


# ---------------------------------------------------------------- validation

def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_mixture(where: str, weights: tuple[float, ...], **lists: tuple[float, ...]) -> None:
    _need(len(weights) > 0, f"{where}.weights must not be empty")
    for key, values in lists.items():
        _need(len(values) == len(weights), f"{where}.{key} has {len(values)} entries, weights {len(weights)}")
    _need(all(w >= 0 for w in weights) and abs(sum(weights) - 1.0) <= 1e-6,
          f"{where}.weights must be non-negative and sum to 1, got {list(weights)}")
    for key in ("sigmas", "stds_tokens"):
        _need(all(s >= 0 for s in lists.get(key, ())), f"{where}.{key} must be >= 0, got {lists.get(key)}")


def _check_scalars(L: Lengths) -> None:
    _need(L.max_tokens >= 1, f"lengths.max_tokens must be >= 1, got {L.max_tokens}")
    _need(L.prompt_sigma >= 0 and L.response_sigma >= 0,
          f"lengths.prompt_sigma and response_sigma must be >= 0, got {L.prompt_sigma}, {L.response_sigma}")
    for key in ("tail_frac", "short_frac", "cap_spike_frac", "copula_rho"):
        value = getattr(L, key)
        _need(0.0 <= value <= 1.0, f"lengths.{key} must be in [0, 1], got {value}")
    _need(L.tail_frac < 1, "lengths.tail_frac must be < 1 (use shape = \"pareto\" for a Pareto body)")
    _need(L.short_frac + L.cap_spike_frac < 1,
          f"lengths.short_frac + cap_spike_frac must be < 1, got {L.short_frac + L.cap_spike_frac}")
    _need(L.short_frac == 0 or 1 <= L.short_tokens <= L.max_tokens,
          f"lengths.short_tokens must be in [1, max_tokens] when short_frac > 0, got {L.short_tokens}")
    _need(L.drift_per_step > -1, f"lengths.drift_per_step must be > -1, got {L.drift_per_step}")
    _need(L.step_jitter_sigma >= 0, f"lengths.step_jitter_sigma must be >= 0, got {L.step_jitter_sigma}")
    _need(L.copula_rho == 0 or L.prompt_sigma == 0,
          "lengths.copula_rho and lengths.prompt_sigma are two correlation schemes: set one, the other 0")


def _check_shape(L: Lengths) -> None:
    _need(L.shape in SHAPES, f"lengths.shape {L.shape!r} unknown; known: {list(SHAPES)}")
    for key in ("lognormal_mixture", "gaussian_mixture"):
        given = getattr(L, key) is not None
        _need(given == (L.shape == key), f"lengths.{key}: a [lengths.{key}] table goes with shape = {key!r}"
              f" ({'missing' if not given else 'shape is ' + repr(L.shape)})")
    wants_pareto = L.shape == "pareto" or L.tail_frac > 0
    _need((L.pareto is not None) == wants_pareto,
          "lengths.pareto: a [lengths.pareto] table goes with shape = \"pareto\" or tail_frac > 0")
    _need(L.shape != "pareto" or L.tail_frac == 0, "lengths.tail_frac: a Pareto body has no separate tail")
    if L.shape == "lognormal2" and not L.empirical and not L.classes:
        _need(L.median_tokens > 0, f"lengths.median_tokens must be > 0, got {L.median_tokens}")
    elif L.response_sigma and not L.empirical and not L.classes:
        raise ValueError(f"lengths.response_sigma is lognormal2's spread; shape {L.shape!r} has its own")


def _check_empirical(L: Lengths) -> None:
    shaped = [k for k in ("tail_frac", "short_frac", "cap_spike_frac", "copula_rho", "drift_per_step",
                          "step_jitter_sigma") if getattr(L, k)]
    if L.shape != "lognormal2":
        shaped.insert(0, "shape")
    _need(not shaped, f"lengths.empirical replays recorded lengths; remove {shaped}")


def _check_classes(L: Lengths) -> None:
    _check_mixture("lengths.classes", tuple(c.weight for c in L.classes))
    shaped = [k for k in ("tail_frac", "short_frac", "cap_spike_frac", "copula_rho") if getattr(L, k)]
    if L.shape != "lognormal2":
        shaped.insert(0, "shape")
    _need(not shaped, f"lengths.classes carry their own lognormals; remove {shaped}")
    for key in ("prompt_sigma", "response_sigma"):
        _need(getattr(L, key) == 0, f"lengths.{key} is set per class with lengths.classes; leave it out")


def _derive(L: Lengths, key: str, value: float) -> None:
    """Fill a derived field; a given one must agree (dataclasses.replace passes it back in)."""
    given = getattr(L, key)
    if given == 0:
        object.__setattr__(L, key, value)
    elif not math.isclose(given, value, rel_tol=1e-9):
        raise ValueError(f"lengths.{key} is derived ({value:.6g}) for this shape; leave it out (got {given})")


# ---------------------------------------------------------------- shapes

def _body_key(L: Lengths) -> tuple:
    """What the body distribution depends on (not the derived median): the grid's cache key."""
    base = (L.median_tokens, L.response_sigma) if L.shape == "lognormal2" else ()
    return (L.shape, base, L.lognormal_mixture, L.gaussian_mixture, L.pareto, L.tail_frac)


def _scipy():
    """scipy on first use: `jigsaw sim --help` and workloads of the default shape never load it."""
    from scipy import special, stats

    return special, stats


def _components(key: tuple) -> list[tuple[float, object]]:
    _, stats = _scipy()
    shape, base, lmix, gmix, pareto, tail = key
    tail_dist = stats.pareto(b=pareto.alpha, scale=pareto.scale_tokens) if pareto else None
    if shape == "lognormal2":
        body = [(1.0, stats.lognorm(s=max(base[1], _TINY), scale=base[0]))]
    elif shape == "lognormal_mixture":
        body = [(w, stats.lognorm(s=max(s, _TINY), scale=m))
                for w, m, s in zip(lmix.weights, lmix.medians_tokens, lmix.sigmas)]
    elif shape == "gaussian_mixture":
        body = [(w, stats.norm(loc=m, scale=max(s, _TINY * max(1.0, abs(m)))))
                for w, m, s in zip(gmix.weights, gmix.means_tokens, gmix.stds_tokens)]
    else:
        return [(1.0, tail_dist)]
    if tail:
        body = [(w * (1 - tail), d) for w, d in body] + [(tail, tail_dist)]
    return [(w, d) for w, d in body if w > 0]


@functools.lru_cache(maxsize=64)
def _grid(key: tuple) -> tuple[np.ndarray, np.ndarray]:
    """(x, CDF(x)) of the body: every component's quantiles at probabilities dense in both tails
    (uniform in normal-score space), so interpolating the mixture CDF is accurate everywhere."""
    comps = _components(key)
    special, _ = _scipy()
    p = special.ndtr(np.linspace(-8.0, 8.0, 1601))
    x = np.unique(np.concatenate([d.ppf(p) for _, d in comps]))
    x = x[np.isfinite(x)]
    cdf = np.maximum.accumulate(sum(w * d.cdf(x) for w, d in comps))
    return x, cdf


def _classes_key(L: Lengths) -> tuple:
    """The grid key of what the classes give over all prompts: each class a lognormal whose
    log-spread adds its prompt and within-prompt spreads."""
    mix = LognormalMixture(weights=tuple(c.weight for c in L.classes),
                           medians_tokens=tuple(c.median_tokens for c in L.classes),
                           sigmas=tuple(math.hypot(c.prompt_sigma, c.response_sigma) for c in L.classes))
    return ("lognormal_mixture", (), mix, None, None, 0.0)


def body_quantile(L: Lengths, u: np.ndarray) -> np.ndarray:
    """Q(u) of the body (no point masses, no cap), tokens, continuous."""
    x, cdf = _grid(_body_key(L))
    return np.interp(u, cdf, x)


def body_cdf(L: Lengths, tokens: np.ndarray) -> np.ndarray:
    x, cdf = _grid(_body_key(L))
    return np.interp(tokens, x, cdf)


def step_factor(L: Lengths, rng: np.random.Generator, step: int) -> float:
    """Drift × jitter of one step; draws from rng only when step_jitter_sigma > 0."""
    f = (1.0 + L.drift_per_step) ** step
    if L.step_jitter_sigma > 0:
        f *= float(np.exp(rng.normal(0.0, L.step_jitter_sigma)))
    return f


def prompt_scales(L: Lengths, rng: np.random.Generator, n: int) -> np.ndarray:
    """(n,) fresh per-prompt scales, tokens.  Two-level: median × exp(N(0, prompt_sigma)), the
    original draw.  Copula: Q(Φ(z_p)), the length at the prompt's latent quantile.  Classes: a
    class per prompt by weight, then its median × exp(N(0, its prompt_sigma))."""
    if L.copula_rho > 0:
        return body_quantile(L, _scipy()[0].ndtr(rng.standard_normal(n)))
    if L.classes:
        return class_scales(L, rng, n)[0]
    return L.median_tokens * np.exp(rng.normal(0.0, L.prompt_sigma, n))


def class_scales(L: Lengths, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(scales, class index) of n fresh prompts of a Lengths with classes."""
    k = rng.choice(len(L.classes), size=n, p=np.array([c.weight for c in L.classes]))
    median = np.array([c.median_tokens for c in L.classes])[k]
    sigma = np.array([c.prompt_sigma for c in L.classes])[k]
    return median * np.exp(sigma * rng.standard_normal(n)), k


def class_index(L: Lengths, scales: np.ndarray) -> np.ndarray:
    """The class each given prompt scale most likely came from (weight × the class's lognormal
    density): a deferred prompt re-sampled keeps its class's within-prompt spread."""
    logs = np.log(np.asarray(scales, dtype=float))[:, None]
    mu = np.log([c.median_tokens for c in L.classes])[None, :]
    sd = np.maximum([c.prompt_sigma for c in L.classes], _TINY)[None, :]
    score = np.log(np.maximum([c.weight for c in L.classes], _TINY)) - np.log(sd) - 0.5 * ((logs - mu) / sd) ** 2
    return np.argmax(score, axis=1)


def class_turns(L: Lengths, rng: np.random.Generator, scale: np.ndarray, k: np.ndarray,
                factor: float) -> np.ndarray:
    """One length per entry of `scale` (its prompt's scale; `k` the prompt's class), ints in
    [1, max_tokens]: a lognormal around the scale with the class's within-prompt spread."""
    sigma = np.array([c.response_sigma for c in L.classes])[k]
    drawn = np.asarray(scale, dtype=float) * factor * np.exp(sigma * rng.standard_normal(len(k)))
    out = np.minimum(L.max_tokens, drawn)
    return np.maximum(1, np.round(out)).astype(int)


def draw_turns(L: Lengths, rng: np.random.Generator, scale: np.ndarray, factor: float) -> np.ndarray:
    """One length per entry of `scale` (the owning prompt's prompt_scale), ints in [1, max_tokens]."""
    n = len(scale)
    if L.copula_rho > 0:
        special, _ = _scipy()
        z_p = special.ndtri(np.clip(body_cdf(L, scale), 1e-12, 1 - 1e-12))
        rho = L.copula_rho
        u = special.ndtr(math.sqrt(rho) * z_p + math.sqrt(1 - rho) * rng.standard_normal(n))
        relative = np.ones(n)
    else:
        u = rng.random(n)
        relative = np.asarray(scale, dtype=float) / L.median_tokens
    s, c = L.short_frac, L.cap_spike_frac
    body = body_quantile(L, np.clip((u - s) / (1 - s - c), 0.0, 1.0)) * relative * factor
    out = np.minimum(L.max_tokens, body)
    if s:
        out = np.where(u < s, L.short_tokens, out)
    if c:
        out = np.where(u >= 1 - c, L.max_tokens, out)
    return np.maximum(1, np.round(out)).astype(int)


# ---------------------------------------------------------------- empirical traces

@dataclass(frozen=True, slots=True)
class Record:
    """One line of an empirical trace."""

    line: int
    """1-based line number in the file (for error messages)."""
    step: int
    """The line's "step" (the file's numbering; only the order matters)."""
    prompt_len: int
    """Prompt tokens."""
    turns: tuple[int, ...]
    """Generated tokens per turn: (response_len,) unless the line gives turn_lens."""
    prompt_id: object
    """The line's prompt_id, or None."""


@dataclass(frozen=True, slots=True)
class Trace:
    """An empirical length trace, records grouped by step in ascending step value."""

    path: str
    """The file."""
    steps: tuple[tuple[Record, ...], ...]
    """Records of each step, in file order."""
    median_tokens: float
    """Median recorded response length (sum of turns)."""


@dataclass(frozen=True, slots=True)
class Batch:
    """One step of a trace, ordered sample-major: sample i belongs to prompt i // group."""

    prompt_tokens: np.ndarray
    """(samples,) recorded prompt lengths."""
    turn_tokens: list[np.ndarray]
    """Per sample: recorded tokens of each turn."""
    prompt_scale: np.ndarray
    """(prompts,) each prompt's mean recorded response length."""


def load_trace(path: str | Path, max_tokens: int) -> Trace:
    """Parse and check a JSONL trace: one {"step", "prompt_len", "response_len"} object per line,
    optional "prompt_id" (groups a step's samples by prompt) and "turn_lens" (a multi-turn sample's
    tokens per turn, summing to response_len when both are given); other keys are ignored, blank
    lines skipped.  Errors name file:line.  Cached on the file's path, size and mtime."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as exc:
        raise ValueError(f"lengths.empirical: cannot read {p}: {exc.strerror}") from None
    return _load_trace(str(p), st.st_size, st.st_mtime_ns, max_tokens)


@functools.lru_cache(maxsize=16)
def _load_trace(path: str, _size: int, _mtime: int, max_tokens: int) -> Trace:
    by_step: dict[int, list[Record]] = {}
    with open(path) as fh:
        for lineno, text in enumerate(fh, 1):
            if text.strip():
                rec = _parse(path, lineno, text, max_tokens)
                by_step.setdefault(rec.step, []).append(rec)
    if not by_step:
        raise ValueError(f"{path}: no records")
    steps = tuple(tuple(by_step[k]) for k in sorted(by_step))
    totals = [sum(r.turns) for recs in steps for r in recs]
    return Trace(path=path, steps=steps, median_tokens=float(np.median(totals)))


def json_object(where: str, text: str) -> dict:
    """One JSONL line as an object, or an error naming where it is (file:line)."""
    try:
        rec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    return rec


def _parse(path: str, lineno: int, text: str, max_tokens: int) -> Record:
    where = f"{path}:{lineno}"
    rec = json_object(where, text)
    step = _int(where, rec, "step", low=0)
    prompt_len = _int(where, rec, "prompt_len", low=1)
    if "turn_lens" in rec:
        turns = rec["turn_lens"]
        if not isinstance(turns, list) or not turns or not all(_is_int(t) and t >= 1 for t in turns):
            raise ValueError(f"{where}: turn_lens must be a non-empty list of positive ints, got {turns!r}")
        if "response_len" in rec and _int(where, rec, "response_len", low=1) != sum(turns):
            raise ValueError(f"{where}: response_len {rec['response_len']} != sum(turn_lens) {sum(turns)}")
        turns = tuple(turns)
    else:
        turns = (_int(where, rec, "response_len", low=1),)
    if sum(turns) > max_tokens:
        raise ValueError(f"{where}: response_len {sum(turns)} above lengths.max_tokens {max_tokens}")
    pid = rec.get("prompt_id")
    if isinstance(pid, (list, dict)):
        raise ValueError(f"{where}: prompt_id must be a string or a number, got {pid!r}")
    return Record(line=lineno, step=step, prompt_len=prompt_len, turns=turns, prompt_id=pid)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(where: str, rec: dict, key: str, *, low: int) -> int:
    if key not in rec:
        raise ValueError(f"{where}: missing {key!r}")
    v = rec[key]
    if not _is_int(v) or v < low:
        raise ValueError(f"{where}: {key} must be an int >= {low}, got {v!r}")
    return v


def _ordered(trace: Trace, recs: tuple[Record, ...], prompts: int, group: int) -> list[Record]:
    """A step's records sample-major; the file must hold exactly prompts × group of them."""
    head = f"{trace.path}:{recs[0].line}: step {recs[0].step}"
    want = prompts * group
    ids = [r.prompt_id is not None for r in recs]
    if any(ids) and not all(ids):
        bad = recs[ids.index(not ids[0])]
        raise ValueError(f"{trace.path}:{bad.line}: step {bad.step} mixes lines with and without prompt_id")
    if len(recs) != want:
        raise ValueError(f"{head} has {len(recs)} samples; the workload's prompts × group is "
                         f"{prompts} × {group} = {want}")
    if not ids[0]:
        return list(recs)
    by_prompt: dict[object, list[Record]] = {}
    for r in recs:
        by_prompt.setdefault(r.prompt_id, []).append(r)
    odd = [(k, len(v)) for k, v in by_prompt.items() if len(v) != group]
    if len(by_prompt) != prompts or odd:
        raise ValueError(f"{head} has {len(by_prompt)} prompt_ids (want {prompts}), sizes off group {group}: "
                         f"{odd[:3]}")
    return [r for v in by_prompt.values() for r in v]


def replay(trace: Trace, step: int, prompts: int, group: int) -> Batch:
    """Simulation step `step` replays the trace's step number step % (steps in the file), i.e. the
    file's distinct step values in ascending order, cycling when the simulation runs longer."""
    recs = _ordered(trace, trace.steps[step % len(trace.steps)], prompts, group)
    totals = np.array([sum(r.turns) for r in recs], dtype=float)
    return Batch(prompt_tokens=np.array([r.prompt_len for r in recs], dtype=int),
                 turn_tokens=[np.array(r.turns, dtype=int) for r in recs],
                 prompt_scale=totals.reshape(prompts, group).mean(axis=1))


def trace_spreads(trace: Trace, prompts: int, group: int) -> tuple[float, float]:
    """(prompt_sigma, response_sigma) of a trace: log-spread of the per-prompt means over all steps,
    and the pooled within-prompt log-spread (0 for group 1).  Checks every step's batch."""
    means, within = [], []
    for k in range(len(trace.steps)):
        b = replay(trace, k, prompts, group)
        logs = np.log([t.sum() for t in b.turn_tokens]).reshape(prompts, group)
        means.append(np.log(b.prompt_scale))
        if group > 1:
            within.append(logs.var(axis=1, ddof=1))
    prompt_sigma = float(np.std(np.concatenate(means)))
    response_sigma = float(np.sqrt(np.mean(np.concatenate(within)))) if within else 0.0
    return prompt_sigma, response_sigma
