"""Workload specs: what one simulated RL pipeline generates and trains on.

    jigsaw/sim/workloads/<name>.toml ─tomllib─► from_dict ─► WorkloadSpec (validated; every parameter
        │        [lengths] ─► lengths.Lengths             has a provenance entry: paper table,
        │        lengths.empirical ─► lengths.load_trace   figure, trace or generator script)
        │                             (each step checked against prompts × group)
        ▼
    sample_step(spec, rng, prompt_scale=None, *, step=0) ─► StepSamples, sample-major:
        prompt tokens, per-turn response tokens, context tokens and tool latency before each later
        turn, reward time per sample (or per batch)

Response lengths default to a two-level lognormal (RollPacker's simulation recipe): each
prompt draws a difficulty scale, each of its responses a length around that scale,
clipped at the generation cap.  That gives the long tails and the within-group
correlation that make some DP workers finish much later than others.  Mixtures, Pareto tails,
point masses, a copula, drift over steps and exact replay of recorded lengths live in lengths.py;
the default keeps its original draws here, call for call, so existing workloads sample exactly as
before.  Every optional field at its default leaves the random stream unchanged.
"""

from __future__ import annotations

import dataclasses
import heapq
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import numpy as np

from jigsaw.graph.buffer import DEFAULT_STALENESS, MODES
from jigsaw.mux.model.specs import DEVICES, MODELS, OFFLOAD_MODES, model_from_config, register_model
from jigsaw.sim import lengths
from jigsaw.sim.lengths import GaussianMixture, Lengths, LognormalMixture, Pareto, PromptClass


@dataclass(frozen=True, kw_only=True, slots=True)
class Turns:
    """How many generation turns a sample takes."""

    probs: tuple[float, ...] = (1.0,)
    """probs[k] = P(k + 1 turns)."""
    context_tokens: int = 0
    """Tokens appended before every later turn (feedback or tool output), median."""
    context_sigma: float = 0.0
    """Log-space spread of those tokens."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Tool:
    """External tool called between turns (Search-R1's retrieval); none if latency is 0."""

    latency_s: float = 0.0
    """Median wall time of one call."""
    latency_sigma: float = 0.0
    """Log-space spread of the call time."""
    blocking: bool = False
    """Calls are batched per worker: a turn's tool call waits for every request of the worker
    to reach it (JigsawRL §3.1, 'blocked tool calls')."""
    max_calls: int = 0
    """Most tool calls of one trajectory (0 = unlimited): a sample drawing more turns is cut to
    max_calls + 1 turns.  Needs a tool (latency_s > 0).  An empirical replay keeps its recorded turns."""
    timeout_s: float = 0.0
    """A call longer than this is cut at it (0 = none): the tail of the call time."""
    tail_frac: float = 0.0
    """Share of calls in a slow tail (a sandbox that hangs, a crawler that retries), in [0, 1):
    rare calls that last minutes, then cut at timeout_s when one is set."""
    tail_latency_s: float = 0.0
    """Median wall time of a tail call (the same log-space spread, latency_sigma); > latency_s."""
    cores: int = 0
    """Host cores the pipeline's tool calls run on, one call per core at a time (a sandbox per
    trajectory), split evenly over its DP rollout workers, at least one each; a call waits for a
    free core.  0: every call runs at once."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Reward:
    """[reward]: reward time as a distribution; replaces reward_s_per_sample when given."""

    median_s: float
    """Median time of one reward call, seconds (> 0)."""
    sigma: float = 0.0
    """Log-space spread of the call time (lognormal)."""
    timeout_s: float = 0.0
    """A call longer than this takes timeout_s and its sample scores as failed (0 = none)."""
    per_batch: bool = False
    """One call scores the whole batch (e.g. a remote judge) instead of one call per sample."""
    workers: int = 1
    """Reward calls running at once: 1, one after another (verl's reward manager); N, a pool of
    N (e.g. one per DP rank); 0, every trajectory's at once (a sandbox each, as a test suite run
    per agent trajectory)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DynamicSampling:
    """[dynamic_sampling] (DAPO): groups whose rewards are all equal are dropped and generation
    repeats until the batch is full.  Stored and validated here; the pipeline acts on it."""

    keep_frac: float
    """Expected fraction of prompts kept after filtering, in (0, 1]."""
    max_gen_batches: int
    """Most generation rounds per step (>= 1)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkloadSpec:
    """One GRPO pipeline: model, deployment, batch and the statistics of what it generates."""

    name: str
    """Workload id (the file name)."""
    description: str
    """One line for tables and --help."""
    model: str
    """Model id in jigsaw.mux.model.specs.MODELS, or the name of the model [model_config] describes."""
    device: str
    """Device id in jigsaw.mux.model.specs.DEVICES ('h100', 'a100')."""
    gpus: int
    """GPUs of the deployment the workload was measured on (DP degree × rollout TP)."""
    rollout_tp: int = 1
    """Tensor parallelism of the rollout engine."""
    fsdp_degree: int = 0
    """FSDP shard degree of training and reference (0 = every GPU its training runs on)."""
    offload: str = "none"
    """Training state in host memory: none | optimizer | full (verl's FSDP optimizer_offload /
    param_offload; what a user turns on when the state does not fit)."""
    prompts: int = 64
    """Prompts per step (JigsawRL §5.1: global batch 64)."""
    group: int = 4
    """Responses per prompt (JigsawRL §5.1: group size 4)."""
    prompt_tokens: float = 150.0
    """Median prompt length."""
    prompt_sigma: float = 0.3
    """Log-space spread of prompt lengths."""
    lengths: Lengths
    """Response tokens per turn."""
    turns: Turns = field(default_factory=Turns)
    """Multi-turn structure."""
    tool: Tool = field(default_factory=Tool)
    """Tool calls between turns."""
    reward_s_per_sample: float = 0.0005
    """Host time of the rule-based reward per sample (negligible, JigsawRL Table 1 note); the
    median per-sample time when [reward] is absent, ignored when it is given."""
    mini_batch_prompts: int = 16
    """Prompts per PPO mini-batch (verl `ppo_mini_batch_size`): one optimizer update each."""
    micro_batch_seqs: int = 8
    """Sequences per training micro-batch per GPU (verl `ppo_micro_batch_size_per_gpu`)."""
    logprob_micro_batch_seqs: int = 16
    """Sequences per log-prob micro-batch per GPU (verl `log_prob_micro_batch_size_per_gpu`)."""
    gradient_checkpointing: bool = False
    """Activation recompute in training (verl `enable_gradient_checkpointing`): four
    forward-equivalents per trained token instead of three."""
    reward: Reward | None = None
    """[reward]: reward time distribution and timeout; None = reward_s_per_sample per sample."""
    trajectory_timeout_s: float = 0.0
    """Wall-clock limit of one trajectory, seconds (0 = none); the pipeline enforces it."""
    ppo_epochs: int = 1
    """Passes over each step's batch in training (verl `ppo_epochs`)."""
    start_step: int = 0
    """The run's step the simulation's first step is (e.g. 40 to see steps 40-49 of a drifting
    run): length drift, step jitter and an empirical trace's steps count from it."""
    dynamic_sampling: DynamicSampling | None = None
    """[dynamic_sampling]: DAPO-style group filtering; None = every group is trained on."""
    gen_prompts: int = 0
    """Prompts generated per round where that differs from the training batch `prompts` (verl
    DAPO's `data.gen_batch_size`): rounds of gen_prompts until `prompts` pass the filter.  0: the
    training batch.  Needs [dynamic_sampling]."""
    model_config: dict | None = None
    """[model_config]: a model jigsaw does not ship, by its HF config.json keys (num_hidden_layers,
    hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim, vocab_size,
    tie_word_embeddings; MoE: num_experts, num_experts_per_tok, moe_intermediate_size) and,
    from its model card, params (else derived from the shapes); known as `model` from then on."""
    mode: str = "sync"
    """How rollout and training meet: sync (a step barrier, verl's default trainer) |
    one-step-off (batch n generated while step n - 1 trains; StreamRL, verl's
    one_step_off_policy) | fully-async (rollouts never wait for a step: in-flight requests
    are interrupted at each weight update and resumed with their partial output; AReaL,
    verl's fully_async_policy).  The asynchronous modes run disaggregated: rollout and training
    workers on devices of their own (`rollout_frac`), joined by a sample buffer
    (graph/buffer.py)."""
    staleness: int | None = None
    """Most weight versions a trained sample may lag the step that trains it (None: the
    mode's, graph/buffer.py DEFAULT_STALENESS: 0 sync, 1 one-step-off, 2 fully-async)."""
    rollout_frac: float = 0.5
    """Share of an asynchronous pipeline's devices its rollout workers get (the rest train);
    0.5: the equal split the JigsawRL paper's StreamRL and AReaL baselines use (§5.3)."""
    carry_frac: float | None = None
    """fully-async: share of a batch still generating when the next batch's prompts are
    submitted; those are interrupted and carried into the next round with their partial
    output (None: 0.25, an assumption; AReaL submits a prompt whenever one finishes)."""
    provenance: dict[str, str] = field(default_factory=dict)
    """Source of every parameter: 'parameter.path' -> paper table / figure / trace."""

    def __post_init__(self) -> None:
        _check(self)

    @property
    def samples(self) -> int:
        return self.prompts * self.group

    @property
    def is_async(self) -> bool:
        return self.mode != "sync"

    @property
    def staleness_bound(self) -> int:
        """The staleness bound in force: the stated one, else the mode's."""
        return DEFAULT_STALENESS[self.mode] if self.staleness is None else self.staleness

    @property
    def carry_share(self) -> float:
        """The share of a batch carried into the next round (0 unless fully-async)."""
        if self.mode != "fully-async":
            return 0.0
        return DEFAULT_CARRY_FRAC if self.carry_frac is None else self.carry_frac


def _check(w: WorkloadSpec) -> None:
    where = f"workload {w.name!r}"
    if w.model_config is not None:
        if not isinstance(w.model_config, dict):
            raise ValueError(f"{where}: [model_config] must be a table of config.json keys, got {w.model_config!r}")
        register_model(w.model, model_from_config(w.model_config, f"{where}: [model_config]"))
    if w.model not in MODELS:
        raise ValueError(f"{where}: model {w.model!r} unknown (describe it in a [model_config] table); "
                         f"known: {sorted(MODELS)}")
    if w.device not in DEVICES:
        raise ValueError(f"{where}: device {w.device!r} unknown; known: {sorted(DEVICES)}")
    if w.gpus < 1 or w.rollout_tp < 1 or w.gpus % w.rollout_tp:
        raise ValueError(f"{where}: gpus ({w.gpus}) must be a positive multiple of rollout_tp ({w.rollout_tp})")
    if min(w.mini_batch_prompts, w.micro_batch_seqs, w.logprob_micro_batch_seqs) < 1:
        raise ValueError(f"{where}: mini/micro batch sizes must be >= 1")
    if w.prompts < 1 or w.group < 1 or w.lengths.median_tokens <= 0 or w.lengths.max_tokens < 1:
        raise ValueError(f"{where}: prompts, group, median and max tokens must be positive")
    p = w.turns.probs
    if not p or any(x < 0 for x in p) or abs(sum(p) - 1.0) > 1e-6:
        raise ValueError(f"{where}: turns.probs must be non-negative and sum to 1, got {p}")
    for ok, message in _new_field_checks(w):
        if not ok:
            raise ValueError(f"{where}: {message}")
    missing = sorted(set(parameter_paths(w)) - set(w.provenance))
    if missing:
        raise ValueError(f"{where}: no provenance for {missing}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _new_field_checks(w: WorkloadSpec) -> Iterator[tuple[bool, str]]:
    t, r, d = w.tool, w.reward, w.dynamic_sampling
    yield _is_int(t.max_calls) and t.max_calls >= 0, f"tool.max_calls must be an int >= 0, got {t.max_calls!r}"
    yield t.timeout_s >= 0, f"tool.timeout_s must be >= 0, got {t.timeout_s}"
    yield t.latency_s > 0 or not (t.max_calls or t.timeout_s), \
        "tool.max_calls and tool.timeout_s need a tool (tool.latency_s > 0)"
    yield _is_int(w.fsdp_degree) and w.fsdp_degree >= 0, f"fsdp_degree must be an int >= 0, got {w.fsdp_degree!r}"
    yield w.offload in OFFLOAD_MODES, f"offload must be one of {OFFLOAD_MODES}, got {w.offload!r}"
    yield w.trajectory_timeout_s >= 0, f"trajectory_timeout_s must be >= 0, got {w.trajectory_timeout_s}"
    yield _is_int(w.ppo_epochs) and w.ppo_epochs >= 1, f"ppo_epochs must be an int >= 1, got {w.ppo_epochs!r}"
    yield _is_int(w.start_step) and w.start_step >= 0, f"start_step must be an int >= 0, got {w.start_step!r}"
    yield from _tool_checks(t)
    if r is not None:
        yield r.median_s > 0, f"reward.median_s must be > 0, got {r.median_s}"
        yield r.sigma >= 0, f"reward.sigma must be >= 0, got {r.sigma}"
        yield r.timeout_s >= 0, f"reward.timeout_s must be >= 0, got {r.timeout_s}"
        yield _is_int(r.workers) and r.workers >= 0, f"reward.workers must be an int >= 0, got {r.workers!r}"
    yield from _async_checks(w)
    yield _is_int(w.gen_prompts) and w.gen_prompts >= 0, f"gen_prompts must be an int >= 0, got {w.gen_prompts!r}"
    yield not w.gen_prompts or d is not None, "gen_prompts needs [dynamic_sampling] (what filters its surplus)"
    if d is not None:
        yield 0 < d.keep_frac <= 1, f"dynamic_sampling.keep_frac must be in (0, 1], got {d.keep_frac}"
        yield _is_int(d.max_gen_batches) and d.max_gen_batches >= 1, \
            f"dynamic_sampling.max_gen_batches must be an int >= 1, got {d.max_gen_batches!r}"


def _async_checks(w: WorkloadSpec) -> Iterator[tuple[bool, str]]:
    yield w.mode in MODES, f"mode must be one of {MODES}, got {w.mode!r}"
    if w.mode not in MODES:
        return
    k = w.staleness
    yield k is None or (_is_int(k) and k >= 0), f"staleness must be an int >= 0, got {k!r}"
    yield k is None or w.is_async or k == 0, f"staleness {k} needs an asynchronous mode (sync trains on fresh samples)"
    yield k is None or not w.is_async or k >= 1, f"{w.mode} needs staleness >= 1 (0 is sync), got {k}"
    yield 0 < w.rollout_frac < 1, f"rollout_frac must be in (0, 1), got {w.rollout_frac}"
    f = w.carry_frac
    yield f is None or w.mode == "fully-async", "carry_frac needs mode = 'fully-async'"
    yield f is None or 0 <= f < 1, f"carry_frac must be in [0, 1), got {f}"
    for what, on in (("[dynamic_sampling]", w.dynamic_sampling is not None), ("gen_prompts", bool(w.gen_prompts))):
        yield not (on and w.is_async), \
            f"{what} with mode {w.mode!r} is not simulated (a dynamic batch has no fixed size)"


def _tool_checks(t: Tool) -> Iterator[tuple[bool, str]]:
    yield 0 <= t.tail_frac < 1, f"tool.tail_frac must be in [0, 1), got {t.tail_frac}"
    yield not t.tail_frac or t.tail_latency_s > t.latency_s > 0, \
        f"tool.tail_latency_s ({t.tail_latency_s}) must exceed tool.latency_s ({t.latency_s}) > 0 with a tail"
    yield _is_int(t.cores) and t.cores >= 0, f"tool.cores must be an int >= 0, got {t.cores!r}"
    yield t.latency_s > 0 or not t.cores, "tool.cores needs a tool (tool.latency_s > 0)"


# Parameters that predate optional fields: each always needs a source (as before), except the
# length fields a non-default shape derives or ignores.  Newer fields need one only when a
# workload moves them off their default, so old files stay valid as the format grows.
_ALWAYS = frozenset(
    ["model", "device", "gpus", "rollout_tp", "prompts", "group", "prompt_tokens", "prompt_sigma",
     "reward_s_per_sample", "mini_batch_prompts", "micro_batch_seqs", "logprob_micro_batch_seqs",
     "gradient_checkpointing", "turns.probs", "turns.context_tokens", "turns.context_sigma",
     "tool.latency_s", "tool.latency_sigma", "tool.blocking"]
    + [f"lengths.{k}" for k in lengths.LEGACY_FIELDS])
DEFAULT_CARRY_FRAC = 0.25
"""fully-async's share of a batch carried into the next round, when a workload does not say."""
_REQUIRED = object()  # the "default" of a field without one: never equal to a value


def parameter_paths(w: WorkloadSpec) -> list[str]:
    """Every parameter that needs a source: the original leaf fields (less the length fields the
    shape derives or ignores) and every newer leaf that differs from its default."""
    skip = {f"lengths.{k}" for k in lengths.derived_fields(w.lengths)}
    return [path for path, value, default in _leaves(w, "")
            if path not in skip and (path in _ALWAYS or value != default)]


def _leaves(obj: object, prefix: str) -> Iterator[tuple[str, object, object]]:
    for f in dataclasses.fields(obj):
        if not prefix and f.name in ("name", "description", "provenance"):
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaves(value, f"{prefix}{f.name}.")
        elif value is not None:
            default = (f.default if f.default is not dataclasses.MISSING else
                       f.default_factory() if f.default_factory is not dataclasses.MISSING else _REQUIRED)
            yield f"{prefix}{f.name}", value, default


# ---------------------------------------------------------------- files

WORKLOAD_DIR = "workloads"


def load(path: str | Path) -> WorkloadSpec:
    """A workload from a TOML file; a relative lengths.empirical is read next to it."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: not valid TOML: {exc}") from None
    try:
        return from_dict(raw, name=path.stem, base=path.parent)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


def from_dict(raw: dict, *, name: str, base: Path | None = None) -> WorkloadSpec:
    """A workload from a parsed TOML table.  An empirical trace is checked here, once, against
    prompts × group (every step), and its prompt/response spreads are derived from it."""
    raw = dict(raw)
    raw.setdefault("name", name)
    try:
        for key, build in _SECTIONS.items():
            if key in raw:
                raw[key] = build(raw[key], base)
        spec = _build(WorkloadSpec, raw, "top level")
        return _bind_trace(spec)
    except (TypeError, ValueError) as exc:
        if str(exc).startswith("workload "):
            raise
        raise ValueError(f"workload {raw['name']!r}: {exc}") from None


def _build(cls: type, table: dict, where: str) -> object:
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table, got {table!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known: {sorted(known)}")
    return cls(**table)


def _lengths(table: dict, base: Path | None) -> Lengths:
    sub = {k: tuple(v) if isinstance(v, list) and k != "classes" else v for k, v in dict(table).items()}
    if "classes" in sub:
        if not isinstance(sub["classes"], list) or not sub["classes"]:
            raise ValueError(f"[[lengths.classes]]: expected a non-empty array of tables, got {sub['classes']!r}")
        sub["classes"] = tuple(_build(PromptClass, c, f"[[lengths.classes]] {i + 1}")
                               for i, c in enumerate(sub["classes"]))
    for key, cls in (("lognormal_mixture", LognormalMixture), ("gaussian_mixture", GaussianMixture),
                     ("pareto", Pareto)):
        if key in sub:
            sub[key] = _build(cls, {k: tuple(v) if isinstance(v, list) else v for k, v in dict(sub[key]).items()},
                              f"[lengths.{key}]")
    if sub.get("empirical"):
        derived = sorted({"median_tokens", "prompt_sigma", "response_sigma"} & set(sub))
        if derived:
            raise ValueError(f"lengths.{derived[0]} is derived from lengths.empirical; leave {derived} out")
        path = Path(sub["empirical"])
        sub["empirical"] = str(path if path.is_absolute() or base is None else base / path)
    return _build(Lengths, sub, "[lengths]")


def _turns(table: dict, base: Path | None) -> Turns:
    sub = dict(table)
    if "probs" in sub:
        sub["probs"] = tuple(sub["probs"])
    return _build(Turns, sub, "[turns]")


_SECTIONS: dict[str, Callable[[dict, Path | None], object]] = {
    "lengths": _lengths,
    "turns": _turns,
    "tool": lambda t, _: _build(Tool, t, "[tool]"),
    "reward": lambda t, _: _build(Reward, t, "[reward]"),
    "dynamic_sampling": lambda t, _: _build(DynamicSampling, t, "[dynamic_sampling]"),
}


def _bind_trace(w: WorkloadSpec) -> WorkloadSpec:
    """Check every step of an empirical trace against the batch and derive its spreads (used to
    re-sample deferred prompts and to draw fresh prompt scales)."""
    L = w.lengths
    if not L.empirical:
        return w
    trace = lengths.load_trace(L.empirical, L.max_tokens)
    prompt_sigma, response_sigma = lengths.trace_spreads(trace, w.prompts, w.group)
    return dataclasses.replace(w, lengths=dataclasses.replace(L, prompt_sigma=prompt_sigma,
                                                                response_sigma=response_sigma))


def shipped() -> dict[str, Path]:
    """Workloads shipped with jigsaw, by name."""
    base = resources.files("jigsaw.sim").joinpath(WORKLOAD_DIR)
    return {p.name[:-5]: Path(str(p)) for p in base.iterdir() if p.name.endswith(".toml")}


def shipped_pairs() -> list[tuple[str, str]]:
    """Every shipped workload paired with itself and with the next of its device kind (by
    name): the pairs the simulator is checked on (tests/integration/test_sim_matrix.py) and
    compared on (bench/shipped_pairs.py)."""
    names = sorted(shipped())
    kind = {n: get(n).device for n in names}
    out = []
    for w in names:
        same = [n for n in names if kind[n] == kind[w]]
        out += [(w, w), (w, same[(same.index(w) + 1) % len(same)])]
    return out


def get(name_or_path: str) -> WorkloadSpec:
    """A shipped workload by name, or a TOML file by path."""
    known = shipped()
    if name_or_path in known:
        return load(known[name_or_path])
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.exists():
        return load(path)
    raise KeyError(f"unknown workload {name_or_path!r}; shipped: {', '.join(sorted(known))}")


# ---------------------------------------------------------------- sampling

@dataclass(frozen=True, slots=True)
class StepSamples:
    """What one RL step generates, sample-major (sample i belongs to prompt i // group)."""

    prompt_tokens: np.ndarray
    """(samples,) prompt length of each sample."""
    turn_tokens: list[np.ndarray]
    """Per sample: generated tokens of each turn."""
    context_tokens: list[np.ndarray]
    """Per sample: tokens appended before each later turn (len = turns - 1)."""
    tool_s: list[np.ndarray]
    """Per sample: tool latency before each later turn (len = turns - 1; zeros without a tool),
    already cut at tool.timeout_s."""
    prompt_scale: np.ndarray
    """(prompts,) difficulty scale, tokens, kept so a deferred prompt can be re-sampled (tail
    batching); an empirical replay's is each prompt's mean recorded response length."""
    reward_s: np.ndarray
    """Reward time, seconds, already cut at reward.timeout_s: (samples,) per sample, or (1,) for
    the whole batch when reward.per_batch.  Without [reward]: reward_s_per_sample each."""
    reward_timed_out: np.ndarray
    """Same shape as reward_s: the call hit reward.timeout_s, its sample(s) score as failed."""


def prompt_scales(w: WorkloadSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    """(n,) fresh prompt scales for sample_step(prompt_scale=...), e.g. tail batching's widened
    round.  lognormal2: median × exp(N(0, prompt_sigma)), the same draw sample_step makes.
    Empirical: drawn from the trace's per-prompt means (pass the workload's own batch, not a
    widened group: the trace's prompts are grouped by it)."""
    L = w.lengths
    if not L.empirical:
        return lengths.prompt_scales(L, rng, n)
    trace = lengths.load_trace(L.empirical, L.max_tokens)
    means = [lengths.replay(trace, k, w.prompts, w.group).prompt_scale for k in range(len(trace.steps))]
    return rng.choice(np.concatenate(means), n)


def sample_step(w: WorkloadSpec, rng: np.random.Generator, prompt_scale: np.ndarray | None = None, *,
                step: int = 0) -> StepSamples:
    """Draw one step's samples; `prompt_scale` re-uses given prompts' difficulty, `step` (0-based)
    sets the length drift and picks an empirical trace's step.

    An empirical workload replays its trace's step exactly when prompt_scale is None
    (lengths.replay: steps cycle when the simulation outlasts the file).  With prompt_scale (a
    deferred prompt re-sampled by tail batching) it draws a lognormal with median at the given
    scale, i.e. around the prompt's recorded mean, with the trace's pooled within-prompt spread."""
    L, step = w.lengths, step + w.start_step
    if L.empirical and prompt_scale is None:
        b = lengths.replay(lengths.load_trace(L.empirical, L.max_tokens), step, w.prompts, w.group)
        return _finish(w, rng, b.prompt_tokens, b.turn_tokens.__getitem__, b.prompt_scale)
    factor = lengths.step_factor(L, rng, step)
    classes = None
    if L.classes:
        prompt_scale, classes = (lengths.class_scales(L, rng, w.prompts) if prompt_scale is None
                                 else (prompt_scale, lengths.class_index(L, prompt_scale)))
    elif prompt_scale is None:
        prompt_scale = lengths.prompt_scales(L, rng, w.prompts)
    n = len(prompt_scale) * w.group
    prompts = np.maximum(1, np.round(w.prompt_tokens * np.exp(rng.normal(0.0, w.prompt_sigma, n)))).astype(int)
    turns = rng.choice(len(w.turns.probs), size=n, p=np.asarray(w.turns.probs)) + 1
    if w.tool.max_calls:
        turns = np.minimum(turns, w.tool.max_calls + 1)
    if classes is not None:
        return _finish(w, rng, prompts, _class_turns(w, rng, prompt_scale, classes, turns, factor), prompt_scale)
    draw = _lognormal_turns if L.legacy or L.empirical else _shaped_turns
    return _finish(w, rng, prompts, draw(w, rng, prompt_scale, turns, factor), prompt_scale)


def _lognormal_turns(w: WorkloadSpec, rng: np.random.Generator, prompt_scale: np.ndarray, turns: np.ndarray,
                     factor: float) -> Callable[[int], np.ndarray]:
    """The original sampler: each sample's turns drawn when the loop reaches it (between its
    context and tool draws), so the random stream is the one existing workloads always had."""
    L = w.lengths
    scale = np.repeat(prompt_scale, w.group)
    if factor != 1.0:
        scale = scale * factor

    def turn(i: int) -> np.ndarray:
        drawn = np.minimum(L.max_tokens, scale[i] * np.exp(rng.normal(0.0, L.response_sigma, int(turns[i]))))
        return _within_cap(np.maximum(1, np.round(drawn)).astype(int), L.max_tokens)
    return turn


def _shaped_turns(w: WorkloadSpec, rng: np.random.Generator, prompt_scale: np.ndarray, turns: np.ndarray,
                  factor: float) -> Callable[[int], np.ndarray]:
    """Every other shape: all turns of the step in one vectorised draw."""
    owner = np.repeat(np.repeat(np.asarray(prompt_scale, dtype=float), w.group), turns)
    parts = np.split(lengths.draw_turns(w.lengths, rng, owner, factor), np.cumsum(turns)[:-1])
    return lambda i: _within_cap(parts[i], w.lengths.max_tokens)


def _class_turns(w: WorkloadSpec, rng: np.random.Generator, prompt_scale: np.ndarray, classes: np.ndarray,
                 turns: np.ndarray, factor: float) -> Callable[[int], np.ndarray]:
    """Prompt classes: every turn of the step in one draw, each with its prompt's class spread."""
    per_turn = np.repeat(np.arange(len(prompt_scale) * w.group) // w.group, turns)
    drawn = lengths.class_turns(w.lengths, rng, np.asarray(prompt_scale)[per_turn], classes[per_turn], factor)
    parts = np.split(drawn, np.cumsum(turns)[:-1])
    return lambda i: _within_cap(parts[i], w.lengths.max_tokens)


def _finish(w: WorkloadSpec, rng: np.random.Generator, prompts: np.ndarray, turn: Callable[[int], np.ndarray],
            prompt_scale: np.ndarray) -> StepSamples:
    turn_tokens, ctx, tool = [], [], []
    for i in range(len(prompts)):
        turn_tokens.append(turn(i))
        k = len(turn_tokens[-1])
        ctx.append(np.round(w.turns.context_tokens * np.exp(rng.normal(0.0, w.turns.context_sigma, k - 1)))
                   .astype(int))
        tool.append(_tool_s(w.tool, rng, k - 1))
        if w.lengths.cap_counts_observations:
            turn_tokens[-1], ctx[-1], tool[-1] = _within_cap_with_observations(
                turn_tokens[-1], ctx[-1], tool[-1], w.lengths.max_tokens)
    reward_s, timed_out = _reward_s(w, rng, len(prompts))
    return StepSamples(prompt_tokens=prompts, turn_tokens=turn_tokens, context_tokens=ctx, tool_s=tool,
                       prompt_scale=prompt_scale, reward_s=reward_s, reward_timed_out=timed_out)


def _tool_s(t: Tool, rng: np.random.Generator, calls: int) -> np.ndarray:
    s = t.latency_s * np.exp(rng.normal(0.0, t.latency_sigma, calls)) if t.latency_s else np.zeros(calls)
    if t.tail_frac:  # drawn only with a tail: the stream of every other workload stays as it was
        slow = rng.random(calls) < t.tail_frac
        s = np.where(slow, s * (t.tail_latency_s / t.latency_s), s)
    return np.minimum(s, t.timeout_s) if t.timeout_s else s


def _reward_s(w: WorkloadSpec, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Without [reward] no draw at all (the stream stays as it was)."""
    r = w.reward
    if r is None:
        return np.full(n, w.reward_s_per_sample), np.zeros(n, dtype=bool)
    s = r.median_s * np.exp(rng.normal(0.0, r.sigma, 1 if r.per_batch else n))
    if not r.timeout_s:
        return s, np.zeros(len(s), dtype=bool)
    return np.minimum(s, r.timeout_s), s > r.timeout_s


def reward_wall_s(w: WorkloadSpec, call_s: np.ndarray) -> float:
    """Wall time of a step's reward calls (each already cut at its timeout) on the workload's
    reward workers, calls taken in order by the first free worker."""
    workers = w.reward.workers if w.reward is not None else 1
    if len(call_s) == 0:
        return 0.0
    if workers == 1:
        return float(np.sum(call_s))
    if workers == 0 or workers >= len(call_s):
        return float(np.max(call_s))
    free = [0.0] * workers
    for c in call_s:
        heapq.heappush(free, heapq.heappop(free) + float(c))
    return max(free)


def _within_cap_with_observations(turns: np.ndarray, ctx: np.ndarray, tool: np.ndarray,
                                  cap: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The cap bounds generated and observation tokens together (turn 0, observation 0, turn 1,
    ...): the turn that reaches it is cut; an observation that reaches it ends the trajectory
    at the turn before (its tool call and the turns after it never happen)."""
    spent = 0
    for j, t in enumerate(turns):
        if spent + t >= cap:
            out = turns[:j + 1].copy()
            out[-1] = max(1, cap - spent)
            return out, ctx[:j], tool[:j]
        spent += int(t)
        if j < len(ctx) and spent + int(ctx[j]) >= cap:
            return turns[:j + 1], ctx[:j], tool[:j]
        spent += int(ctx[j]) if j < len(ctx) else 0
    return turns, ctx, tool


def _within_cap(turns: np.ndarray, cap: int) -> np.ndarray:
    """The cap bounds a whole response: later turns are cut once the total reaches it."""
    total = np.cumsum(turns)
    if total[-1] <= cap:
        return turns
    keep = int(np.searchsorted(total, cap, side="left")) + 1
    out = turns[:keep].copy()
    out[-1] -= int(total[keep - 1] - cap)
    return out[out > 0] if np.any(out > 0) else out[:1]
