"""What a prior starts from: devices, models, and how a model is deployed (PriorConfig).

    DEVICES: DeviceInfo of each GPU (datasheets) + link, network and PCIe bandwidths
    MODELS:  ModelSpec of each decoder, dense or MoE (HF config.json, model cards)
    PriorConfig: deployment (rollout TP, FSDP degree, offload), representative shapes and
                 the calibration constants of the roofline
    Deployment = (model name, PriorConfig) ─► roofline.py ─► prior.py ─► grids.py

Plain data and their provenance; nothing here times anything (roofline.py does).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from jigsaw.mux.model.slowdown import DeviceInfo

# NVIDIA H100 Tensor Core GPU datasheet (SXM5: BF16 1,979 TFLOPS with sparsity = 989 dense,
# 3.35 TB/s HBM3, 80 GB, taken as 80 GiB) and the Hopper architecture whitepaper (132 SMs on H100 SXM5).
H100 = DeviceInfo(sku="H100-SXM5-80GB", num_sms=132, mem_bytes=80 * 2**30, peak_flops=989e12,
                  mem_bw_bytes_per_s=3.35e12)
# NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB: BF16 312 TFLOPS dense, 2,039 GB/s) and the
# Ampere architecture whitepaper (108 SMs on A100).
A100 = DeviceInfo(sku="A100-SXM4-80GB", num_sms=108, mem_bytes=80 * 2**30, peak_flops=312e12,
                  mem_bw_bytes_per_s=2.039e12)
DEVICES = {"h100": H100, "a100": A100}
PCIE_BW_BYTES_PER_S = {"H100-SXM5-80GB": 55e9, "A100-SXM4-80GB": 25e9}
"""Host<->device copy bandwidth per GPU, achieved (PCIe Gen5 x16 / Gen4 x16: 64 / 32 GB/s
per direction theoretical); what training-state offload pays."""
CPU_ADAM_PARAMS_PER_S = 1.0e9
"""Adam updates per second on the host for one rank's shard (verl's param_offload runs the
optimizer on the CPU; a vectorised CPU Adam on a server socket, estimate)."""
OFFLOAD_MODES = ("none", "optimizer", "full")
LINK_BW_BYTES_PER_S = {H100.sku: 450e9, A100.sku: 300e9}
"""NVLink bandwidth per direction (datasheets: 900 GB/s and 600 GB/s bidirectional)."""
NET_BW_BYTES_PER_S = {H100.sku: 50e9, A100.sku: 25e9}
"""Inter-node bandwidth per GPU: DGX H100 has one 400 Gb/s NDR port per GPU; the A100
nodes of JigsawRL §5.1 are taken with one 200 Gb/s HDR port per GPU (DGX A100)."""
GPUS_PER_NODE = {H100.sku: 8, A100.sku: 4}
"""GPUs per node: DGX H100 (8); JigsawRL §5.1's A100 cluster has 4 GPUs per node."""

DEVICE_KIND_NAMES = ("rollout_prefill", "rollout_decode", "rollout_tail", "reference", "training")
"""Grid kinds, in `jigsaw.graph.substage.DEVICE_KINDS` order (names only: no graph import)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Architecture numbers of a decoder, dense or MoE, from its public HF `config.json`.

    Memory (weights, KV pool, FSDP state and gathers) scales with `params`, all of them;
    FLOPs scale with `flop_params`, what one token multiplies: all of a dense model, the
    published activated count of an MoE.  Weight reads of a forward depend on its rows
    (`weight_read_bytes`): a few decode rows touch few experts, a large batch all of them."""

    params: float
    """Published parameter count (embeddings included); for an MoE the total, every expert."""
    num_layers: int
    """`num_hidden_layers`."""
    hidden_size: int
    """`hidden_size`."""
    intermediate_size: int
    """`intermediate_size` of the SwiGLU MLP of a dense layer (unused when every layer is MoE)."""
    num_heads: int
    """`num_attention_heads` (query heads); attention FLOPs scale with it."""
    num_kv_heads: int
    """`num_key_value_heads` (GQA); the KV cache scales with it."""
    head_dim: int
    """`head_dim` (hidden_size / num_heads where the config omits it)."""
    vocab: int
    """`vocab_size`; logits traffic scales with it."""
    tie_word_embeddings: bool
    """Whether the LM head shares the embedding matrix (only used to re-derive `params`)."""
    num_experts: int = 0
    """`num_experts`: routed experts of every layer's MoE block (`decoder_sparse_step` 1, no
    `mlp_only_layers`); 0 for a dense model."""
    experts_per_token: int = 0
    """`num_experts_per_tok`: routed experts (top-k) each token runs through, per layer."""
    moe_intermediate_size: int = 0
    """`moe_intermediate_size`: SwiGLU width of one routed expert."""
    shared_expert_intermediate_size: int = 0
    """SwiGLU width of the always-active shared expert(s) (Qwen2-MoE's field; DeepSeek's
    n_shared_experts x moe_intermediate_size); 0 if none, as in Qwen3-MoE."""
    active_params: float = 0.0
    """Published activated parameters per token (MoE model card); 0 for a dense model."""

    @property
    def weight_bytes(self) -> float:
        return 2.0 * self.params  # BF16

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2  # K and V, BF16

    @property
    def flop_params(self) -> float:
        """Parameters one token multiplies: `active_params` of an MoE, else `params`."""
        return self.active_params or self.params

    @property
    def mlp_width(self) -> int:
        """SwiGLU width one token's activations pass through per layer (elementwise traffic)."""
        if not self.num_experts:
            return self.intermediate_size
        return self.experts_per_token * self.moe_intermediate_size + self.shared_expert_intermediate_size

    @property
    def expert_params(self) -> float:
        """Routed-expert parameters of all layers (0 for a dense model)."""
        return float(self.num_layers * self.num_experts * 3 * self.hidden_size * self.moe_intermediate_size)

    def weight_read_bytes(self, rows: float) -> float:
        """Weight bytes one forward over `rows` tokens reads from HBM (all ranks together).

        An MoE layer reads only the experts its rows were routed to: with uniform routing an
        expert is untouched by all rows with probability (1 - k/E)^rows, so the expected
        fraction read is 1 - (1 - k/E)^rows (1/16 of the experts at one Qwen3-30B-A3B row,
        all of them at a large batch).  Everything else is read whole."""
        if not self.num_experts:
            return self.weight_bytes
        touched = 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** max(rows, 1.0)
        return 2.0 * (self.params - self.expert_params * (1.0 - touched))

    def derived_params(self) -> float:
        """Parameter count re-derived from the shapes (checks `params`; biases/norms ignored)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.num_experts:  # routed experts, the router, and shared experts
            shared = 3 * h * self.shared_expert_intermediate_size
            mlp = self.expert_params / self.num_layers + h * self.num_experts + shared
        else:
            mlp = 3 * h * self.intermediate_size
        per_layer = h * q * 2 + h * kv * 2 + mlp
        return self.num_layers * per_layer + self.vocab * h * (1 if self.tie_word_embeddings else 2)

    def derived_active_params(self) -> float:
        """Per-token parameters re-derived: all of them less the routed experts a token skips."""
        skipped = self.num_experts - self.experts_per_token
        return self.derived_params() - self.expert_params * skipped / max(self.num_experts, 1)


_MOE_FIELDS = ("num_experts", "experts_per_token", "moe_intermediate_size", "shared_expert_intermediate_size",
               "active_params")


def spec_dict(spec: ModelSpec) -> dict:
    """A spec as recorded in a prior's `source`; MoE fields at their dense default are left out,
    so a dense model's file reads as it did before MoE support."""
    return {k: v for k, v in asdict(spec).items() if k not in _MOE_FIELDS or v}


# Values from the models' HF config.json files (Qwen/Qwen3-0.6B, Qwen/Qwen3-4B,
# meta-llama/Llama-3.1-8B, meta-llama/Llama-3.1-70B, deepseek-ai/DeepSeek-R1-Distill-Qwen-14B, Qwen/Qwen3-32B,
# Qwen/Qwen3-30B-A3B); `params` (and an MoE's `active_params`) from the model cards
# (Qwen3-30B-A3B: 30.5B total, 3.3B activated).
MODELS = {
    "qwen3-0.6b": ModelSpec(params=0.6e9, num_layers=28, hidden_size=1024, intermediate_size=3072,
                            num_heads=16, num_kv_heads=8, head_dim=128, vocab=151936, tie_word_embeddings=True),
    "qwen3-4b": ModelSpec(params=4.0e9, num_layers=36, hidden_size=2560, intermediate_size=9728,
                          num_heads=32, num_kv_heads=8, head_dim=128, vocab=151936, tie_word_embeddings=True),
    "llama-3.1-8b": ModelSpec(params=8.03e9, num_layers=32, hidden_size=4096, intermediate_size=14336,
                              num_heads=32, num_kv_heads=8, head_dim=128, vocab=128256,
                              tie_word_embeddings=False),
    "deepseek-r1-distill-qwen-14b": ModelSpec(params=14.8e9, num_layers=48, hidden_size=5120,
                                              intermediate_size=13824, num_heads=40, num_kv_heads=8,
                                              head_dim=128, vocab=152064, tie_word_embeddings=False),
    "qwen3-32b": ModelSpec(params=32.8e9, num_layers=64, hidden_size=5120, intermediate_size=25600,
                           num_heads=64, num_kv_heads=8, head_dim=128, vocab=151936, tie_word_embeddings=False),
    "qwen3-30b-a3b": ModelSpec(params=30.5e9, active_params=3.3e9, num_layers=48, hidden_size=2048,
                               intermediate_size=6144, num_heads=32, num_kv_heads=4, head_dim=128, vocab=151936,
                               tie_word_embeddings=False, num_experts=128, experts_per_token=8,
                               moe_intermediate_size=768),
    "llama-3.1-70b": ModelSpec(params=70.6e9, num_layers=80, hidden_size=8192, intermediate_size=28672,
                               num_heads=64, num_kv_heads=8, head_dim=128, vocab=128256, tie_word_embeddings=False),
}


def model_from_config(cfg: dict, where: str = "model") -> ModelSpec:
    """A decoder from its HF `config.json` keys (dense, or MoE with `num_experts`), the way a
    user describes a model jigsaw does not ship.  `params` (and an MoE's `active_params`) from the
    model card when given, else derived from the shapes."""
    known = {"num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
             "head_dim", "vocab_size", "tie_word_embeddings", "num_experts", "num_experts_per_tok",
             "moe_intermediate_size", "shared_expert_intermediate_size", "params", "active_params"}
    try:
        heads = cfg["num_attention_heads"]
        spec = ModelSpec(params=float(cfg.get("params", 0.0)), num_layers=cfg["num_hidden_layers"],
                         hidden_size=cfg["hidden_size"], intermediate_size=cfg.get("intermediate_size", 0),
                         num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
                         head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab=cfg["vocab_size"],
                         tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                         num_experts=cfg.get("num_experts", 0), experts_per_token=cfg.get("num_experts_per_tok", 0),
                         moe_intermediate_size=cfg.get("moe_intermediate_size", 0),
                         shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
                         active_params=float(cfg.get("active_params", 0.0)))
    except KeyError as exc:
        raise ValueError(f"{where}: lacks {exc.args[0]!r} (HF config.json names; known: {sorted(known)})") from None
    _check_shape(spec, where)
    if not spec.params:
        spec = replace(spec, params=spec.derived_params())
    if spec.num_experts and not spec.active_params:
        spec = replace(spec, active_params=spec.derived_active_params())
    return spec


def _check_shape(spec: ModelSpec, where: str) -> None:
    counts = {k: getattr(spec, k) for k in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                                            "vocab")}
    bad = [k for k, v in counts.items() if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if bad or spec.num_heads % spec.num_kv_heads:
        raise ValueError(f"{where}: {bad or ['num_key_value_heads']} must be positive integers, the query "
                         f"heads a multiple of the KV heads; got {counts}")
    if not spec.num_experts and spec.intermediate_size < 1:
        raise ValueError(f"{where}: a dense model needs intermediate_size")
    if spec.num_experts and not (0 < spec.experts_per_token <= spec.num_experts and spec.moe_intermediate_size > 0):
        raise ValueError(f"{where}: an MoE needs 0 < num_experts_per_tok <= num_experts and moe_intermediate_size")


def register_model(name: str, spec: ModelSpec) -> None:
    """Make `name` known to everything that looks a model up by name (costs, priors, grids); a
    name jigsaw ships, or registered before, must keep its shape."""
    if MODELS.get(name, spec) != spec:
        raise ValueError(f"model {name!r} is already known with another shape; give yours another name")
    MODELS[name] = spec


@dataclass(frozen=True, kw_only=True, slots=True)
class PriorConfig:
    """Deployment, representative shapes and calibration constants of the prior."""

    rollout_tp: int = 1
    """Tensor-parallel degree of the rollout engine (weights and KV heads split over it)."""
    fsdp_degree: int = 4
    """FSDP shard degree of training and reference (JigsawRL Fig. 7: Qwen3-4B on 4 GPUs)."""
    node_gpus: int = 0
    """GPUs of the node the deployment runs on: a shard group larger than it runs its collectives
    at the inter-node bandwidth.  0: the kind's usual node (GPUS_PER_NODE)."""
    prefill_tokens: int = 8192
    """Tokens per prefill forward: SGLang's default chunked-prefill size on 80 GB GPUs."""
    prefill_context_tokens: int = 1024
    """Mean prompt length attended to during prefill (math/agentic RL prompts)."""
    decode_max_batch: int = 768
    """Running-request cap of large-batch decode, inside the paper's [128,1024) bucket; with
    `rollout_reserve_bytes` calibrated to the Qwen3-32B 80%->40% memory figure (§4.2, 1.43x)."""
    decode_context_tokens: int = 1024
    """Mean KV length per running request early in rollout, when most requests are active."""
    tail_batch: int = 32
    """Time-weighted mean batch of the long tail, which decays from 128 to 1 (bucket [0,128))."""
    tail_context_tokens: int = 4096
    """Mean KV length of long-tail requests (the longest responses)."""
    train_micro_batch_tokens: int = 4096
    """Training micro-batch at ample memory (verl: a few sequences per GPU per micro-batch)."""
    train_min_micro_batch_tokens: int = 1024
    """Smallest micro-batch worth running; less memory than that is infeasible."""
    train_seq_tokens: int = 2048
    """Representative training sequence length (prompt + response) where no samples are known:
    the prior's grids price attention FLOPs with it.  The simulator prices each micro-batch by
    its own sequences instead (ΣL²/ΣL, `costmodel.micro_batch_shapes`)."""
    train_tokens_per_step: int = 65536
    """Tokens per GPU per optimizer step; amortises the optimizer update."""
    ref_micro_batch_tokens: int = 8192
    """Reference (log-prob) micro-batch at ample memory: forward only, so larger."""
    gemm_eff: float = 0.75
    """Tensor-core efficiency of large GEMMs (typical cuBLAS BF16 on Hopper/Ampere)."""
    gemm_half_tokens: int = 1024
    """Micro-batch tokens at which training GEMM efficiency is half of `gemm_eff` (Fig. 9 trend)."""
    bw_eff: float = 0.7
    """Achievable fraction of peak HBM bandwidth (eager elementwise kernels, decode attention)."""
    bw_sat_sm_frac: float = 0.4
    """SM share below which streaming kernels (elementwise, copies, weight reads) cannot
    saturate HBM; with `train_host_s_per_micro_batch` calibrated to Fig. 7 (training 2.7x at
    25% SMs) while training stays busy enough that two trainings sharing SMs contend (Fig. 8)."""
    attn_bw_sat_sm_frac: float = 0.7
    """The same for decode attention over the KV cache, which keeps few loads in flight per SM
    between softmax steps; calibrated to Fig. 7 (large-batch rollout 2.7x slower at 25% SMs)."""
    fill_rows: int = 128
    """Rows (tokens) per forward that fill the device; the paper's tail bucket boundary, and
    what makes small-batch decode SM-insensitive (Fig. 7)."""
    elementwise_passes: float = 12.0
    """HBM passes over (hidden + intermediate) activations per token per layer and forward:
    unfused norms, rotary, SwiGLU, residual adds, casts and GEMM inputs/outputs (estimate)."""
    logits_passes: float = 3.0
    """FP32 passes over the vocab logits per token and forward (write, softmax, gather)."""
    fsdp_copy_passes: float = 2.0
    """HBM copies of the unsharded weights per pass (all-gather copy-out, reduce-scatter copy-in)."""
    train_forward_passes: float = 4.0
    """Forward-equivalents per trained token: forward, activation-checkpoint recompute (verl's
    default), and a backward worth two forwards."""
    train_state_bytes_per_param: float = 16.0
    """FP32 master weights + grads + Adam m, v, sharded by FSDP (verl mixed precision)."""
    optimizer_bytes_per_param: float = 28.0
    """HBM traffic of one Adam update per (sharded) parameter: read 16, write 12."""
    rollout_reserve_bytes: int = 4 * 2**30
    """Activations, CUDA graphs and sampler buffers the rollout engine keeps outside the KV pool;
    calibrated with `decode_max_batch` to the Qwen3-32B memory figure (§4.2, 1.43x)."""
    train_reserve_bytes: int = 2 * 2**30
    """Allocator fragmentation and NCCL buffers beside the training state."""
    host_s_per_forward: float = 1.5e-3
    """Rollout host time per forward (scheduling, sampling, detokenising, log-probs)."""
    layer_latency_s: float = 20e-6
    """Launch/sync latency per layer and forward pass that no SM count shortens."""
    allreduce_latency_s: float = 30e-6
    """Latency of one small TP all-reduce over NVLink (NCCL, ~tens of µs); two per layer when
    rollout_tp > 1."""
    train_host_s_per_micro_batch: float = 0.07
    """Host time per training micro-batch (loss, entropy and log-prob bookkeeping, FSDP hooks);
    calibrated to Fig. 7 (training 2.7x slower at 25% SMs)."""
    ref_host_s_per_micro_batch: float = 0.05
    """Host time per reference micro-batch (log-prob gather only, no loss or backward hooks)."""
    partition_interference: float = 0.05
    """Extra time of the busy parts when co-located in green-context partitions (L2, scheduler)."""
    shared_interference: float = 0.10
    """Extra time-sharing overhead of unpartitioned co-location (context switches between the
    two clients' CTAs); calibrated to Fig. 8 (compute-bound pairs up to 2.19x)."""
    offload: str = "none"
    """Training state in host memory (verl FSDP): none; optimizer (Adam m, v offloaded between
    updates, copied in for each update); full (params, grads and optimizer on the host, the
    update on the CPU, shards copied in for every gather)."""

    def __post_init__(self) -> None:
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"offload must be one of {OFFLOAD_MODES}, got {self.offload!r}")

    def state_bytes_per_param(self, *, train: bool) -> float:
        """Training (or reference) state kept on the device per parameter of a shard."""
        if self.offload == "full":
            return 0.0
        if not train:
            return 2.0
        return self.train_state_bytes_per_param - (8.0 if self.offload == "optimizer" else 0.0)


def config_dict(cfg: PriorConfig) -> dict:
    """The config as files record it (offload only when on: shipped priors stay as they were)."""
    out = asdict(cfg)
    if out["offload"] == "none":
        del out["offload"]
    return out


Deployment = tuple[str, PriorConfig]
"""(model name in MODELS, its PriorConfig): one model as a node deploys it."""
