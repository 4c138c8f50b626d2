"""Typed, versioned messages between pipeline workers and their node: the only way facts enter it.

    client ── [length][msgpack(Request)] ──► daemon ── [length][msgpack(Reply)] ──► client
              one message ≤ MAX_MESSAGE_BYTES, field `v` = PROTOCOL_VERSION,
              `req` echoed so a client can drop stale replies
    a simulated worker ── the same Request objects, in process ──► the simulator's node
    a daemon's trace ── the requests it took (node/inputs.py) ──► a replay of its decisions

Every fact the node's view reads comes in as one of these requests (node/inputs.py maps
them onto the node state): what a worker asks for and finishes, and what its engine knows
(`Progress`, `Samples`, `Lengths`, `NoRollout`) or guesses (`Forecast`).  The simulator
sends nothing a live worker could not.

Framing is wire.py's (a length prefix on a Unix stream socket); encoding and schema
validation are msgspec's.  Decoding never runs
code from the peer: msgpack carries data only, and a message that does not match the
schema (unknown type tag, wrong field type, unknown field, other version) becomes a
`ProtocolError` that the daemon answers with an `Error` reply.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from jigsaw.graph.buffer import MODES
from jigsaw.mux.partition.partitioners import Partition

PROTOCOL_VERSION = 9
"""2: typed partitions in grants, the processes of a sub-stage, fail-open reports.
3: pipelines owned by a token; the trace's state in status replies.
4: the daemon's set-up and uptime, and each pipeline's requests and grants, in status
replies; `Stop`.
5: a heartbeat may wait for a budget change (`Heartbeat.wait_s`): re-plans reach workers
at once, not at their next heartbeat.
6: an operator's migration order (`Migrate`, `jigsaw daemon migrate`); a migration's source
is told of it like a budget change.
7: what an engine knows reaches the node as it reaches the simulator's: `Progress` (a piece's
requests now), `Samples`, `Lengths`, `NoRollout`, `Forecast`; a pipeline's step count and
response cap at registration; a request's own ordinal, size and head start in `Admit`.
8: an asynchronous job's sides: `Register.job`, its `mode` and staleness bound.
9: a pipeline whose ranks span nodes (`Register.nodes`): its collective sub-stages wait for
the cluster to admit their gang on every node at once."""
MAX_MESSAGE_BYTES = 64 << 10
"""Largest request the daemon reads (the largest real one, an Admit naming 4,096 processes,
is about 20 KiB): a longer one is refused from its length prefix, before its body is read."""
HEARTBEAT_S = 0.25
"""How often a client renews its lease (the daemon says so at registration; this is the
value until it does)."""
LEASE_S = 1.0
"""A client silent this long loses its grants."""
MAX_WAIT_S = 60.0
"""The longest a heartbeat may be held (`Heartbeat.wait_s`), so a daemon's `heartbeat_s` is at most this."""

# ------------------------------------------------------------------ field bounds
# Every request field is bounded where it is decoded: a value outside these never reaches
# the daemon's state (NaN and infinities fail the bounds, too).  Names are what sub-stage
# ids are built from, so they cannot hold the id separator.
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"
Name = Annotated[str, Meta(pattern=NAME_PATTERN)]
JOB_PATTERN = r"^$|" + NAME_PATTERN
NodeId = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")]
"""A node of a cluster, as Ray names it (56 hex digits) or as the operator does."""
NAME_RULE = "1-64 letters, digits, '.', '_', '+' or '-', starting with a letter or digit"
MAX_TOKEN, MAX_REF, MAX_REQ = 128, 512, 1 << 62
Token = Annotated[str, Meta(max_length=MAX_TOKEN)]
Word = Annotated[str, Meta(max_length=32)]
SubStageRef = Annotated[str, Meta(max_length=MAX_REF)]
Rank = Annotated[int, Meta(ge=0, le=1 << 16)]
StepNo = Annotated[int, Meta(ge=0, le=10**9)]
Pid = Annotated[int, Meta(ge=1, le=1 << 22)]
Bytes = Annotated[int, Meta(ge=0, le=1 << 50)]
Count = Annotated[int, Meta(ge=0, le=10**15)]
Amount = Annotated[float, Meta(ge=0.0, le=1e9)]
"""Batch sizes, sequence lengths, seconds."""
Tokens = Annotated[int, Meta(ge=0, le=1 << 24)]
"""Tokens of one request or turn."""
MAX_LIST = 8192
"""Most entries of a list of numbers in one message (a longer one is sent in parts)."""
MAX_STALENESS = 1 << 20
"""Largest staleness bound a pipeline may state, in weight versions."""
Flops = Annotated[float, Meta(ge=0.0, le=1e30)]


class _Msg(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, frozen=True, kw_only=True):
    v: int = PROTOCOL_VERSION
    req: Annotated[int, Meta(ge=0, le=MAX_REQ)] = 0


# ------------------------------------------------------------------ requests

class Register(_Msg, tag="register"):
    """A client process joins `pipeline` (created on first use); the reply carries its session."""

    pipeline: Name
    pid: Pid
    devices: Annotated[tuple[Rank, ...], Meta(max_length=4096)] = ()
    """Device of each DP rank of the pipeline (default: rank r on device r)."""
    owner: Token = ""
    """The job's secret (`jigsaw run` hands it to its command in $JIGSAW_OWNER): a pipeline
    is joined only with the token it was created with, so another job using the same name
    is refused instead of taking the pipeline over ("" joins a pipeline created without)."""
    steps: StepNo = 0
    """RL steps the pipeline runs in all (0: not said; the scheduler then always expects
    another step after this one)."""
    max_tokens: Tokens = 0
    """Its response cap in tokens (0: not said); with it, turn lengths (`Lengths`) tell how
    long a live tail still runs."""
    slo_slowdown: Annotated[float, Meta(ge=0.0, le=1000.0)] = 0.0
    """Its steps may take at most this × their exclusive time (`jigsaw run --slo`, >= 1;
    0: no SLO); the scheduler keeps it where it can and says when it cannot."""
    job: Annotated[str, Meta(pattern=JOB_PATTERN)] = ""
    """The asynchronous job this pipeline is one side of (its rollout or its training, joined
    by a sample buffer: graph/buffer.py); "" for a pipeline that is a whole job.  Policies
    that give the node to one job at a time (serial) give it to both sides together."""
    mode: Literal[("", *MODES)] = ""
    """How the job's sides are coupled (graph/buffer.py MODES; "" not said): one-step-off
    generates batch n with weights n - staleness, fully-async with the newest, its running
    requests interrupted by every update."""
    staleness: Annotated[int, Meta(ge=0, le=MAX_STALENESS)] = 0
    """The job's bound: a trained sample was generated by weights at most this many versions
    old (0: not said, or synchronous).  The framework enforces it; the daemon keeps it in the
    trace beside the pipeline."""
    nodes: Annotated[tuple[NodeId, ...], Meta(max_length=1024)] = ()
    """Every node the pipeline's ranks run on, this one included, where they are more than
    one (the cluster's node ids): its collective sub-stages (training, reference) start on
    this node only when the cluster controller admits their gang on all of them at once
    (runtime/spanning.py).  () : this node only."""


class Heartbeat(_Msg, tag="heartbeat"):
    session: Token
    wait_s: Annotated[float, Meta(ge=0.0, le=MAX_WAIT_S)] = 0.0
    """The daemon may hold the reply this long (at most half a lease), answering at once
    when one of the session's budgets changes; 0: answer now."""


class Unregister(_Msg, tag="unregister"):
    session: Token
    pipeline_done: bool = False
    """Set by `jigsaw run` when CMD exits: the whole pipeline leaves, not only this client."""


class Admit(_Msg, tag="admit"):
    """Ask to start a sub-stage; the reply (a `Grant`) comes when the scheduler admits it."""

    session: Token
    kind: Word
    dp_rank: Rank
    step: StepNo
    mem_bytes: Bytes = 0
    urgent: bool = False
    """A rollout worker entering its next regime cannot pause: admitted at once, the
    scheduler only picks its budget."""
    pids: Annotated[tuple[Pid, ...], Meta(max_length=4096)] = ()
    """Processes that run the sub-stage: the client binds them to its partition (traced)."""
    label: Word = ""
    """The framework's own name for the work (verl's stage, e.g. "old_log_prob"); traced only."""
    ordinal: Annotated[int, Meta(ge=-1, le=1 << 20)] = -1
    """Its ordinal among this kind's sub-stages on this worker in this step, as the worker
    counts them (-1: the daemon counts)."""
    expected_s: Amount = 0.0
    """The worker's own estimate of its exclusive seconds (0: not known; predicted)."""
    batch_size: Amount = 0.0
    """Sequences it processes, when the worker knows (a stage whose batch is done)."""
    elapsed_s: Amount = 0.0
    """Seconds it already ran before it asked (a rollout regime is recognised some forward
    steps into it)."""
    computes: bool = False
    """Host work (a tool) that computes on this node's CPU with processes of its own (a code
    tool run here), not a wait for work elsewhere: on a CPU node it keeps its pipeline's share
    of the cores and its processes run on the cores no device sub-stage holds (its grant's
    partition).  A reward always computes; a tool without it is a wait."""


class Done(_Msg, tag="done"):
    """A granted sub-stage finished; the numbers feed the pipeline's graph of the next step."""

    session: Token
    substage: SubStageRef
    batch_size: Amount = 0.0
    seq_len: Amount = 0.0
    num_steps: Count = 1
    num_tokens: Count = 0
    flops: Flops = 0.0
    final: bool = False
    """The worker has no more rollout in this step (what was predicted after it will not run)."""


class Opened(_Msg, tag="opened"):
    """A sub-stage ran without the daemon's control (fail-open), reported once a daemon
    answers again: the trace counts every one."""

    session: Token
    kind: Word
    dp_rank: Rank
    step: StepNo
    reason: Word
    """unreachable (no daemon answered) | refused (an Error reply) | lost (its grant was
    reclaimed while it ran, e.g. a lease expired)."""
    substage: SubStageRef = ""
    """Its id, when it had been granted one."""
    duration_s: Amount = 0.0


class Progress(_Msg, tag="progress"):
    """What a rollout engine knows now about its waiting or running sub-stage: the requests it
    holds (decoding, or queued for their prefill).  Sent when they change, before the node
    decides; the view prices a tail by its requests' residual life."""

    session: Token
    substage: SubStageRef
    requests: Count = 0
    """Requests it holds."""
    context_tokens: Amount = 0.0
    """Their mean context (KV tokens per request)."""
    generated: Annotated[tuple[Tokens, ...], Meta(max_length=MAX_LIST)] = ()
    """Tokens each has generated in its current turn (at most MAX_LIST: the longest-running)."""
    mem_bytes: Bytes | None = None
    """Memory its engine needs for them now (None: not known; what it asked with stands)."""


class Samples(_Msg, tag="samples"):
    """How far a step's rollout is: samples finished of all (what whole-stage baselines, such
    as RollMux's tail consolidation at 80%, go by)."""

    session: Token
    step: StepNo
    done: Count
    total: Count


class Lengths(_Msg, tag="lengths"):
    """Lengths (generated tokens) of finished turns: one observation of how long responses
    run.  More than MAX_LIST go in several messages, all but the last with `more`."""

    session: Token
    turns: Annotated[tuple[Tokens, ...], Meta(max_length=MAX_LIST)]
    more: bool = False


class NoRollout(_Msg, tag="no_rollout"):
    """DP rank `dp_rank` has no rollout in `step` (its routing sent it nothing)."""

    session: Token
    dp_rank: Rank
    step: StepNo


class Piece(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One sub-stage of a forecast step."""

    kind: Word
    dp_rank: Rank
    duration_s: Amount
    mem_bytes: Bytes = 0


class Forecast(_Msg, tag="forecast"):
    """The pipeline's own guess of step `step` before it has run one (e.g. every response at
    its cap): per stage a chain of pieces per worker, in order; stages in RL order with a
    barrier between them.  Replaced by the node's own prediction once a step has run."""

    session: Token
    step: StepNo
    pieces: Annotated[tuple[Piece, ...], Meta(max_length=4096)]


class StepEnd(_Msg, tag="step_end"):
    """An RL step of the pipeline finished (sent by one worker, e.g. rank 0)."""

    session: Token
    step: StepNo
    tokens: Count = 0
    samples: Count = 0
    flops: Flops = 0.0


class Status(_Msg, tag="status"):
    """Who is registered and what runs where (also the liveness probe of `jigsaw run`)."""


class Stop(_Msg, tag="stop"):
    """Ask the daemon to exit (`jigsaw daemon stop`); it answers Ok, then cleans up and exits.
    Only the daemon's own uid reaches its socket."""


class Migrate(_Msg, tag="migrate"):
    """An operator's order (`jigsaw daemon migrate`): the requests in flight of `pipeline`'s
    rollout on DP rank `source_rank` move to `target_rank` (aborted there, resumed here with
    their partial output).  Answered `Migrated`, or an Error saying why nothing can move."""

    pipeline: Name
    source_rank: Rank
    target_rank: Rank
    owner: Token = ""
    """The pipeline's owner token (its `jigsaw run` keeps it in the runtime directory's owners/)."""


Request = (Register | Heartbeat | Unregister | Admit | Done | Progress | Samples | Lengths | NoRollout | Forecast
           | Opened | StepEnd | Status | Stop | Migrate)
FACTS = (Admit, Done, Progress, Samples, Lengths, NoRollout, Forecast, Opened)
"""Requests that carry facts of a pipeline (node/inputs.py takes them)."""


# ------------------------------------------------------------------ replies

class Ok(_Msg, tag="ok"):
    pass


class Error(_Msg, tag="error"):
    code: str
    """bad-message | version | too-large | refused | unknown-session | out-of-order |
    name-taken | bad-request (valid, but not on this node) | scheduler (the scheduler failed
    and the request runs without it) | internal"""
    message: str


class Registered(_Msg, tag="registered"):
    session: str
    heartbeat_s: float
    lease_s: float


class MigrationOrder(msgspec.Struct, frozen=True, kw_only=True):
    source: str
    target: str
    source_rank: int
    target_rank: int


class Grant(_Msg, tag="grant"):
    """Admission of a sub-stage, or (in heartbeat replies) a budget change of a running one."""

    substage: str
    device: int
    sm_frac: float
    mem_bytes: int
    micro_batch: int | None = None
    routing: tuple[float, ...] | None = None
    migrations: tuple[MigrationOrder, ...] = ()
    partition: Partition | None = None
    """What the budget is on the device (mux/partition/partitioners.py); None for host work."""


class Beat(_Msg, tag="beat"):
    """Heartbeat reply: current budgets of the session's running sub-stages."""

    grants: tuple[Grant, ...] = ()


class PipelineInfo(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    clients: int
    step: int
    running: tuple[str, ...]
    pending: tuple[str, ...]
    requested: int = 0
    """Sub-stages its processes asked for since it registered (0: nothing in the pipeline
    talks to the daemon)."""
    granted: int = 0
    """Sub-stages admitted since it registered."""
    slo_slowdown: float = 0.0
    """Its step SLO: a step may take at most this × its exclusive time (0: none)."""
    slo_kept: int = 0
    """Finished steps within the SLO."""
    slo_steps: int = 0
    """Finished steps held to the SLO."""
    last_slowdown: float = 0.0
    """The last finished step's latency over its exclusive time (0: no step finished)."""
    slo_given_up: str = ""
    """Why the latest plan gives its SLO up ("" when it keeps it, or has no forecast for it)."""


class StatusReply(_Msg, tag="status_reply"):
    pid: int
    pipelines: tuple[PipelineInfo, ...]
    refused: int
    errors: int
    scheduler_failures: int = 0
    """Decisions in which the policy failed (the fallback decided, or requests ran without
    the daemon): nonzero means some input broke the scheduler; the daemon's log says which."""
    trace: str = ""
    """off | writing PATH | stopped: why (a trace that cannot be written stops; the daemon
    keeps serving)."""
    uptime_s: float = 0.0
    policy: str = ""
    profile: str = ""
    """The grid as the daemon was given it (a name or a file); "" for the default prior."""
    grid: str = ""
    """The grid file it loaded, or which analytic prior."""
    devices: int = 0
    partitioner: str = ""
    idle_exit_s: float | None = None
    """It exits after this long with no pipeline registered (None: never)."""


class Migrated(_Msg, tag="migrated"):
    """A migration order carried out by the daemon: its source sub-stage has been told."""

    source: str
    target: str
    """The target's running rollout sub-stage ("" when none runs: its worker asks anew)."""


Reply = Ok | Error | Registered | Grant | Beat | StatusReply | Migrated


# ------------------------------------------------------------------ codec

def check_name(name: str) -> str:
    """`name` if the daemon accepts it as a pipeline name, else a ValueError that says why."""
    if not re.fullmatch(NAME_PATTERN, name):
        raise ValueError(f"pipeline name {name!r} is not valid: {NAME_RULE}")
    return name


def safe_name(text: str) -> str:
    """`text` made a valid pipeline name (other characters become '-')."""
    name = re.sub(r"[^A-Za-z0-9._+-]", "-", text).lstrip("._+-")[:64]
    return name or "pipeline"


class ProtocolError(ValueError):
    """A message answered with an `Error` of `code`: invalid, or valid but refused by the
    daemon (another job's name, more memory than a device has, an unknown session)."""

    def __init__(self, code: str, message: str, *, req: int = 0, release: tuple[str, str] | None = None):
        super().__init__(message)
        self.code, self.req = code, req
        """`req`: the refused frame's own request id, when it could be read (its sender waits
        for the reply with it)."""
        self.release = release
        """(session, sub-stage) of a Done refused for its report: the grant it ends is still
        given back (the report is dropped, the release is not)."""


class _Envelope(msgspec.Struct):
    """What a refused frame may still say of itself, each field read only if well formed."""

    type: object = None
    req: object = 0
    session: object = ""
    substage: object = ""


_dec_envelope = msgspec.msgpack.Decoder(_Envelope)


def _refused(code: str, message: str, data: bytes) -> ProtocolError:
    """The error for a frame that failed validation, carrying what its envelope names."""
    try:
        env = _dec_envelope.decode(data)
    except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
        return ProtocolError(code, message)
    req = env.req if type(env.req) is int and 0 <= env.req <= MAX_REQ else 0
    release = None
    if env.type == "done" and type(env.session) is str and type(env.substage) is str \
            and 0 < len(env.session) <= MAX_TOKEN and 0 < len(env.substage) <= MAX_REF:
        release = (env.session, env.substage)
    return ProtocolError(code, message, req=req, release=release)


_enc = msgspec.msgpack.Encoder()
_dec_request = msgspec.msgpack.Decoder(Request)
_dec_reply = msgspec.msgpack.Decoder(Reply)


class _Version(msgspec.Struct):
    v: int = PROTOCOL_VERSION


_dec_version = msgspec.msgpack.Decoder(_Version)


def encode(msg: _Msg) -> bytes:
    return _enc.encode(msg)


def decode_request(data: bytes) -> Request:
    """Validate one request frame; raises ProtocolError with the reason, and nothing else:
    whatever the bytes are (invalid UTF-8 in a string, nesting past the recursion limit,
    a value out of bounds), the daemon gets a reason to send back."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError("too-large", f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        msg = _dec_request.decode(data)
    except msgspec.ValidationError as exc:
        _check_version(data)
        raise _refused("bad-message", f"invalid request: {exc}", data) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError("bad-message", f"not a msgpack request: {exc}") from None
    except RecursionError:
        raise ProtocolError("bad-message", "not a request: values nested too deeply") from None
    if msg.v != PROTOCOL_VERSION:
        raise ProtocolError("version", f"protocol version {msg.v} is not supported (daemon speaks {PROTOCOL_VERSION})")
    return msg


def _check_version(data: bytes) -> None:
    try:
        v = _dec_version.decode(data).v
    except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError):
        return
    if v != PROTOCOL_VERSION:
        raise ProtocolError("version", f"protocol version {v!r} is not supported (daemon speaks {PROTOCOL_VERSION})")


def decode_reply(data: bytes) -> Reply:
    try:
        return _dec_reply.decode(data)
    except (msgspec.MsgspecError, UnicodeDecodeError, RecursionError) as exc:
        raise ProtocolError("bad-message", f"invalid reply from daemon: {exc}") from None
