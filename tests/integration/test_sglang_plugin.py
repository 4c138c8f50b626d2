"""The SGLang plugin: contracts against sglang 0.5.12's source (parsed from its wheel, never imported), then
the hooks driven on CPU with fake batches through a real datagram socket into the real ForwardSink."""

from __future__ import annotations

import enum
import os
import queue
import shutil
import socket
import sys
import tempfile
import threading
import time
import types
import zipfile
from dataclasses import dataclass, field

import pytest
import sglang_source as src

from jigsaw.integrations.sglang import plugin
from jigsaw.integrations.sglang.forward_sink import RECORD, ForwardSink, encode_record
from jigsaw.integrations.sglang.pdmux import GrantReader, make_adjust_stream_groups_hook, pick_stream_idx

pytestmark = pytest.mark.timeout(60)

WAIT_S = 5.0  # every wait on the sink ends by this deadline

# ---------------------------------------------------------------------------------------------- contracts

SCHED = "sglang/srt/managers/scheduler.py"
MUX = "sglang/srt/multiplex/multiplexing_mixin.py"
PDMUX = "sglang/srt/multiplex/pdmux_context.py"
PLUGINS = "sglang/srt/plugins/__init__.py"
HOOKS = "sglang/srt/plugins/hook_registry.py"
ARGS = "sglang/srt/server_args.py"
BATCH = "sglang/srt/managers/schedule_batch.py"
MODE = "sglang/srt/model_executor/forward_batch_info.py"
RUNNER = "sglang/srt/model_executor/model_runner.py"


def _c(kind: str, file: str, target: str, expect: object) -> src.Contract:
    return src.Contract(kind=kind, file=file, target=target, expect=expect)


CONTRACTS = [
    # The run_batch hook: signature, identity fields, and where SGLang loads plugins.
    _c("def", SCHED, "Scheduler.run_batch", ("self", "batch")),
    _c("selfattr", SCHED, "Scheduler.__init__", "tp_rank"),
    _c("selfattr", SCHED, "Scheduler.__init__", "pp_rank"),
    _c("def", SCHED, "Scheduler.abort_request", ("self", "recv_req")),
    _c("def", SCHED, "run_scheduler_process", ("server_args", "port_args", "gpu_id", "tp_rank")),
    _c("calls", SCHED, "run_scheduler_process", "load_plugins"),
    _c("def", PLUGINS, "load_plugins", ()),
    _c("calls", PLUGINS, "load_plugins", "apply_hooks"),
    _c("uses", PLUGINS, "load_plugins", "GENERAL_PLUGINS_GROUP"),
    _c("const", PLUGINS, "GENERAL_PLUGINS_GROUP", "sglang.srt.plugins"),
    _c("uses", PLUGINS, "load_plugins_by_group", "SGLANG_PLUGINS"),
    _c("def", HOOKS, "HookRegistry.register", ("cls", "target", "hook", "hook_type")),
    _c("member", HOOKS, "HookType", "AROUND"),
    # What forward_counts reads from a batch.
    _c("field", BATCH, "ScheduleBatch", "forward_mode"),
    _c("field", BATCH, "ScheduleBatch", "extend_num_tokens"),
    _c("field", BATCH, "ScheduleBatch", "decoding_reqs"),
    _c("field", BATCH, "ScheduleBatch", "split_index"),
    _c("def", BATCH, "ScheduleBatch.batch_size", ("self",)),
    *[_c("member", MODE, "ForwardMode", m) for m in ("EXTEND", "DECODE", "MIXED", "IDLE", "SPLIT_PREFILL")],
    *[_c("def", MODE, f"ForwardMode.{p}", ("self",)) for p in ("is_extend", "is_decode", "is_mixed", "is_idle")],
    # The pdmux hook: stream groups, their SM counts, and the attention backend that must follow the index.
    _c("base", SCHED, "Scheduler", "SchedulerMultiplexMixin"),
    _c("def", MUX, "SchedulerMultiplexMixin.adjust_stream_groups", ("self",)),
    _c("calls", MUX, "SchedulerMultiplexMixin.adjust_stream_groups", "update_decode_attn_backend"),
    _c("def", MUX, "SchedulerMultiplexMixin.event_loop_pdmux", ("self",)),
    _c("selfattr", MUX, "SchedulerMultiplexMixin.init_pdmux", "sm_counts"),
    _c("selfattr", MUX, "SchedulerMultiplexMixin.init_pdmux", "stream_groups"),
    _c("def", PDMUX, "set_current_stream_idx", ("idx",)),
    _c("def", PDMUX, "get_current_stream_idx", ()),
    _c("def", PDMUX, "get_sm_counts", ()),
    _c("def", PDMUX, "initialize_stream_groups", ("gpu_id", "config")),
    _c("field", PDMUX, "PDMuxConfig", "sm_group_num"),
    _c("field", PDMUX, "PDMuxConfig", "manual_divisions"),
    _c("def", RUNNER, "ModelRunner.update_decode_attn_backend", ("self", "stream_idx")),
    # 0.5.23 made ServerArgs a msgspec.Struct, which breaks verl's dataclasses.fields(ServerArgs).
    _c("decorated", ARGS, "ServerArgs", "dataclass"),
    *[_c("field", ARGS, "ServerArgs", f) for f in ("enable_pdmux", "pdmux_config_path", "sm_group_num")],
]


@pytest.fixture(scope="module")
def wheel():
    try:
        return src.find_wheel()  # downloads it into .wheels/ the first time
    except src.WheelUnavailable as exc:
        why = str(exc)
    pytest.fail(f"the SGLang contract tests need sglang {src.SGLANG_VERSION}'s wheel: {why}", pytrace=False)


FAKE_PIP = """import sys, time
from pathlib import Path
with open(sys.argv[1], "a") as calls:
    calls.write("fetch\\n")
time.sleep(0.3)
Path(sys.argv[2], "sglang-{v}-py3-none-any.whl").write_bytes(b"PK")
"""


def test_the_wheel_is_fetched_once_by_parallel_runs(tmp_path, monkeypatch):
    import concurrent.futures

    monkeypatch.delenv("JIGSAW_SGLANG_WHEEL", raising=False)
    script, calls = tmp_path / "pip.py", tmp_path / "calls"
    script.write_text(FAKE_PIP.format(v=src.SGLANG_VERSION))
    fetch = (sys.executable, str(script), str(calls))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        found = list(pool.map(lambda _: src.find_wheel(tmp_path / "wheels", fetch), range(4)))
    assert len(set(found)) == 1 and found[0].parent == tmp_path / "wheels"
    assert calls.read_text() == "fetch\n"  # one download; the others waited on the lock and found it
    assert [p.name for p in (tmp_path / "wheels").iterdir() if p.name != ".lock"] == [found[0].name]


def test_a_failed_fetch_says_how_to_provide_the_wheel(tmp_path, monkeypatch):
    monkeypatch.delenv("JIGSAW_SGLANG_WHEEL", raising=False)
    fetch = (sys.executable, "-c", "import sys; sys.exit('ERROR: No matching distribution found')")
    with pytest.raises(src.WheelUnavailable, match="No matching distribution.*JIGSAW_SGLANG_WHEEL"):
        src.find_wheel(tmp_path, fetch)
    assert not list(tmp_path.glob("*.whl")) and not list(tmp_path.glob(".download-*"))
    monkeypatch.setenv("JIGSAW_SGLANG_WHEEL", str(tmp_path / "nowhere.whl"))
    with pytest.raises(src.WheelUnavailable, match="JIGSAW_SGLANG_WHEEL=.*nowhere.whl is not a file"):
        src.find_wheel(tmp_path, fetch)


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: c.id)
def test_sglang_still_has(wheel, contract):
    assert src.check(src.parse(wheel, contract.file), contract) == []


def _mutated(c: src.Contract) -> src.Contract:
    expect = (*c.expect, "mutated") if isinstance(c.expect, tuple) else f"{c.expect}_mutated"
    return src.Contract(kind=c.kind, file=c.file, target=c.target, expect=expect)


def _renamed(c: src.Contract) -> src.Contract:
    return src.Contract(kind=c.kind, file=c.file, target=f"{c.target}_renamed", expect=c.expect)


@pytest.mark.parametrize("contract", CONTRACTS, ids=lambda c: c.id)
def test_contract_fails_on_drift(wheel, contract):
    # A check that passes whatever the source says would let a renamed SGLang name through silently.
    module = src.parse(wheel, contract.file)
    for drifted in (_mutated(contract), _renamed(contract)):
        problems = src.check(module, drifted)
        assert problems and drifted.target.split(".")[0] in problems[0]


@pytest.mark.parametrize("target", [plugin.RUN_BATCH_TARGET, plugin.ADJUST_STREAM_GROUPS_TARGET])
def test_plugin_targets_resolve(wheel, target):
    # HookRegistry resolves the dotted path with getattr, so an inherited method counts.
    assert src.resolve_method(wheel, target) is not None, target


# ------------------------------------------------------------------------------------------------- fakes


class FakeForwardMode(enum.Enum):
    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    SPLIT_PREFILL = 9

    def is_extend(self):  # as in 0.5.12: MIXED and SPLIT_PREFILL are extends too
        return self in (FakeForwardMode.EXTEND, FakeForwardMode.MIXED, FakeForwardMode.SPLIT_PREFILL)

    def is_decode(self):
        return self is FakeForwardMode.DECODE

    def is_mixed(self):
        return self is FakeForwardMode.MIXED

    def is_idle(self):
        return self is FakeForwardMode.IDLE


@dataclass
class FakeBatch:
    forward_mode: FakeForwardMode
    extend_num_tokens: int | None = None
    decoding_reqs: list | None = None
    reqs: list = field(default_factory=list)
    split_index: int = 0

    def batch_size(self) -> int:
        return len(self.reqs)


@dataclass
class FakeScheduler:
    tp_rank: int = 0
    pp_rank: int = 0


def fake_run_batch(sched, batch, pp_proxy_tensors=None):
    return ("result", batch)


MARKER = FakeBatch(FakeForwardMode.EXTEND, extend_num_tokens=987_654)


@pytest.fixture
def short_dir():
    # pytest's tmp_path can exceed AF_UNIX's 107 bytes; /tmp cannot.
    path = tempfile.mkdtemp(prefix="jg-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sink(short_dir):
    got: queue.Queue = queue.Queue()
    s = ForwardSink(short_dir, lambda replica, prefill, decode: got.put((replica, prefill, decode)))
    s.got = got
    yield s
    assert s.close(deadline_s=2.0)


def until_marker(s: ForwardSink) -> list[tuple[int, int, int]]:
    """Everything before the marker record; datagrams on one AF_UNIX socket arrive in order."""
    out, deadline = [], time.monotonic() + WAIT_S
    while True:
        rec = s.got.get(timeout=max(deadline - time.monotonic(), 0.001))
        if rec[1] == MARKER.extend_num_tokens:
            return out
        out.append(rec)


# -------------------------------------------------------------------------------------- run_batch hook


@pytest.mark.parametrize("batch, want", [
    (FakeBatch(FakeForwardMode.EXTEND, extend_num_tokens=300), [(3, 300, 0)]),
    (FakeBatch(FakeForwardMode.DECODE, reqs=list(range(7))), [(3, 0, 7)]),
    (FakeBatch(FakeForwardMode.MIXED, extend_num_tokens=305, decoding_reqs=list(range(5)), reqs=list(range(9))),
     [(3, 300, 5)]),
    (FakeBatch(FakeForwardMode.IDLE, extend_num_tokens=0), []),
    (FakeBatch(FakeForwardMode.SPLIT_PREFILL, extend_num_tokens=4096, split_index=0), [(3, 4096, 0)]),
    (FakeBatch(FakeForwardMode.SPLIT_PREFILL, extend_num_tokens=4096, split_index=12), []),
], ids=["extend", "decode", "mixed", "idle", "split-prefill-first-chunk", "split-prefill-later-chunk"])
def test_counts_reach_the_sink(sink, batch, want):
    hook = plugin.make_run_batch_hook(plugin.ForwardReporter(sink.path, replica=3))
    sched = FakeScheduler()
    assert hook(fake_run_batch, sched, batch) == ("result", batch)
    hook(fake_run_batch, sched, MARKER)
    assert until_marker(sink) == want
    assert sink.gaps == sink.malformed == 0


def test_batch_passed_by_keyword_is_counted(sink):
    hook = plugin.make_run_batch_hook(plugin.ForwardReporter(sink.path, replica=0))
    batch = FakeBatch(FakeForwardMode.DECODE, reqs=[1, 2])
    assert hook(fake_run_batch, FakeScheduler(), batch=batch, pp_proxy_tensors=None) == ("result", batch)
    hook(fake_run_batch, FakeScheduler(), MARKER)
    assert until_marker(sink) == [(0, 0, 2)]


@pytest.mark.parametrize("sched", [FakeScheduler(tp_rank=1), FakeScheduler(pp_rank=1)], ids=["tp1", "pp1"])
def test_only_rank_zero_reports(sink, sched):
    hook = plugin.make_run_batch_hook(plugin.ForwardReporter(sink.path, replica=3))
    batch = FakeBatch(FakeForwardMode.DECODE, reqs=[1])
    assert hook(fake_run_batch, sched, batch) == ("result", batch)
    hook(fake_run_batch, FakeScheduler(), MARKER)
    assert until_marker(sink) == []


def never_waits(reporter: plugin.ForwardReporter) -> bool:
    """Its socket is non-blocking: a send that would wait fails at once instead (and is a drop)."""
    return reporter._sock is not None and reporter._sock.gettimeout() == 0.0


def test_no_receiver_neither_blocks_nor_raises(short_dir):
    reporter = plugin.ForwardReporter(os.path.join(short_dir, "nobody.sock"), replica=1)
    hook = plugin.make_run_batch_hook(reporter)
    batch = FakeBatch(FakeForwardMode.EXTEND, extend_num_tokens=10)
    for _ in range(100):
        assert hook(fake_run_batch, FakeScheduler(), batch) == ("result", batch)
    assert never_waits(reporter)
    assert (reporter.sent, reporter.dropped) == (0, 100)  # one try per forward: nothing retried


def test_full_receiver_drops_instead_of_blocking(short_dir):
    path = os.path.join(short_dir, "deaf.sock")
    deaf = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # bound, never read
    deaf.bind(path)
    try:
        reporter = plugin.ForwardReporter(path, replica=1)
        hook = plugin.make_run_batch_hook(reporter)
        batch = FakeBatch(FakeForwardMode.DECODE, reqs=[1])
        hook(fake_run_batch, FakeScheduler(), batch)
        assert never_waits(reporter)  # before the buffer fills: a reporter that blocks would hang below
        for _ in range(4999):
            hook(fake_run_batch, FakeScheduler(), batch)
        assert reporter.sent and reporter.dropped > 0 and reporter.sent + reporter.dropped == 5000
    finally:
        deaf.close()


def test_sglang_errors_pass_through_unchanged(sink):
    hook = plugin.make_run_batch_hook(plugin.ForwardReporter(sink.path, replica=3))
    err = RuntimeError("CUDA out of memory")

    def failing_run_batch(sched, batch):
        raise err

    with pytest.raises(RuntimeError) as info:
        hook(failing_run_batch, FakeScheduler(), FakeBatch(FakeForwardMode.EXTEND, extend_num_tokens=5))
    assert info.value is err
    hook(fake_run_batch, FakeScheduler(), MARKER)
    assert until_marker(sink) == []  # a forward that failed is not reported


def test_unreadable_batch_is_dropped_not_raised(short_dir):
    reporter = plugin.ForwardReporter(os.path.join(short_dir, "x.sock"), replica=1)
    hook = plugin.make_run_batch_hook(reporter)
    odd = object()
    assert hook(fake_run_batch, FakeScheduler(), odd) == ("result", odd)
    assert reporter.dropped == 1


# ------------------------------------------------------------------------------------------------- load


class FakeRegistry:
    def __init__(self):
        self.hooks: dict[str, object] = {}

    def __call__(self, target, hook):
        self.hooks[target] = hook


@pytest.mark.parametrize("environ", [
    {},
    {"JIGSAW_FORWARD_SOCK": "/tmp/x.sock", "JIGSAW_SM_FRAC_FILE": "/tmp/f"},
    {"JIGSAW_ENABLE": "0", "JIGSAW_FORWARD_SOCK": "/tmp/x.sock", "JIGSAW_SM_FRAC_FILE": "/tmp/f"},
    {"JIGSAW_ENABLE": "1"},
], ids=["empty", "not-enabled", "enable-0", "enabled-nothing-to-do"])
def test_load_registers_nothing_unless_enabled_with_work(environ):
    registry = FakeRegistry()
    assert plugin.load(register=registry, environ=environ) == ()
    assert registry.hooks == {}


def test_load_registers_both_hooks_and_reads_replica(sink, short_dir):
    registry = FakeRegistry()
    environ = {"JIGSAW_ENABLE": "1", "JIGSAW_FORWARD_SOCK": sink.path, "JIGSAW_REPLICA": "5",
               "JIGSAW_SM_FRAC_FILE": os.path.join(short_dir, "grant")}
    targets = plugin.load(register=registry, environ=environ)
    assert targets == (plugin.RUN_BATCH_TARGET, plugin.ADJUST_STREAM_GROUPS_TARGET)
    assert set(registry.hooks) == set(targets)
    run_batch_hook = registry.hooks[plugin.RUN_BATCH_TARGET]
    run_batch_hook(fake_run_batch, FakeScheduler(), FakeBatch(FakeForwardMode.DECODE, reqs=[1, 2, 3]))
    run_batch_hook(fake_run_batch, FakeScheduler(), MARKER)
    assert until_marker(sink) == [(5, 0, 3)]


def test_load_never_raises_into_sglang():
    def broken_registry(target, hook):
        raise RuntimeError("registry gone")

    environ = {"JIGSAW_ENABLE": "1", "JIGSAW_FORWARD_SOCK": "/tmp/x.sock"}
    assert plugin.load(register=broken_registry, environ=environ) == ()


# ------------------------------------------------------------------------------------------------- sink


def test_sink_counts_malformed_and_keeps_going(sink):
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    good = dict(replica=1, seq=1, prefill_tokens=1, decode_reqs=0, t_mono_s=0.0)
    bad = [b"", b"x", b"NOPE" + encode_record(**good)[4:], encode_record(**{**good, "decode_reqs": -1}),
           encode_record(**good) + b"!"]
    for data in bad:
        sender.sendto(data, sink.path)
    plugin.ForwardReporter(sink.path, replica=1).report(MARKER.extend_num_tokens, 0, 0.0)
    assert until_marker(sink) == []
    assert sink.malformed == len(bad) and sink.is_alive()
    sender.close()


def test_sink_survives_a_raising_callback(short_dir):
    calls = queue.Queue()

    def on_forward(replica, prefill, decode):
        calls.put(prefill)
        raise ValueError("consumer bug")

    with ForwardSink(short_dir, on_forward) as s:
        reporter = plugin.ForwardReporter(s.path, replica=0)
        reporter.report(1, 0, 0.0)
        reporter.report(2, 0, 0.0)
        assert [calls.get(timeout=WAIT_S), calls.get(timeout=WAIT_S)] == [1, 2]
        assert s.callback_errors >= 1 and s.is_alive()


def test_sink_counts_gaps_from_sequence_numbers(sink):
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    for seq in (1, 2, 5):
        sender.sendto(encode_record(replica=2, seq=seq, prefill_tokens=0, decode_reqs=1, t_mono_s=0.0), sink.path)
    sender.sendto(encode_record(replica=2, seq=6, prefill_tokens=MARKER.extend_num_tokens, decode_reqs=0,
                                t_mono_s=0.0), sink.path)
    assert len(until_marker(sink)) == 3
    assert sink.gaps == 2
    sender.close()


def test_sink_closes_within_deadline_and_removes_its_socket(short_dir):
    s = ForwardSink(short_dir, lambda *a: None)
    assert s.close(deadline_s=WAIT_S)
    assert not os.path.exists(s.path) and not s.is_alive()


def test_a_sink_whose_thread_is_stuck_closes_at_its_deadline_and_says_so(short_dir):
    """close() waits for the thread no longer than it was told: a consumer stuck in its
    callback (held here until the test lets it go) makes it return False, not hang."""
    inside, free = threading.Event(), threading.Event()

    def stuck(*counts):
        inside.set()
        free.wait(WAIT_S)

    s = ForwardSink(short_dir, stuck)
    try:
        plugin.ForwardReporter(s.path, replica=0).report(1, 0, 0.0)
        assert inside.wait(WAIT_S), "the record never reached the callback"
        assert s.close(deadline_s=0.1) is False
        assert not os.path.exists(s.path)
    finally:
        free.set()


def test_sink_replaces_a_stale_socket(short_dir):
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stale.bind(os.path.join(short_dir, "forward.sock"))
    stale.close()  # the file stays, as after a crash
    with ForwardSink(short_dir, lambda *a: None) as s:
        assert s.is_alive()


def test_sink_refuses_a_path_too_long_for_af_unix():
    with pytest.raises(ValueError, match="AF_UNIX"):
        ForwardSink("/tmp/" + "d" * 120, lambda *a: None)


def test_record_is_small():
    assert RECORD.size == 40


# ------------------------------------------------------------------------------------------------ pdmux

H100_SMS = 132
SM_COUNTS = [(H100_SMS, 0), (112, 20), (96, 36), (72, 60), (0, H100_SMS)]


@pytest.mark.parametrize("sm_frac, sm_counts, want", [
    (1.0, SM_COUNTS, 4),
    (2.0, SM_COUNTS, 4),  # above the whole GPU: the whole GPU
    (0.99, SM_COUNTS, 3),
    (0.5, SM_COUNTS, 3),  # 66 SMs: 60 fits
    (36 / H100_SMS, SM_COUNTS, 2),  # exactly 36
    (0.27, SM_COUNTS, 1),  # 35.6 SMs: 36 does not fit
    (0.05, SM_COUNTS, 1),  # below every group: the smallest
    (0.0, SM_COUNTS, None),
    (-0.5, SM_COUNTS, None),
    (float("nan"), SM_COUNTS, None),
    (0.5, [], None),
    (0.5, [(H100_SMS, 0)], None),
    (0.5, [(0, 0), (0, 0)], None),
    (0.5, [(H100_SMS, 0), (64, 64), (68, 64), (0, H100_SMS)], 2),  # tie on decode SMs: more prefill SMs
    (0.5, [(H100_SMS, 0), (40, 40), (40, 40), (0, H100_SMS)], 1),  # full tie: lower index
    (0.5, [(H100_SMS, 0), (24, 40), (0, H100_SMS)], 1),  # manual division that leaves SMs idle
])
def test_pick_stream_idx(sm_frac, sm_counts, want):
    assert pick_stream_idx(sm_frac, sm_counts) == want


def write_atomically(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def test_grant_reader_polls_at_most_every_poll_s(short_dir):
    path = os.path.join(short_dir, "grant")
    now_s = [0.0]
    reader = GrantReader(path, poll_s=0.05, clock=lambda: now_s[0])
    assert reader.sm_frac() is None  # no file: no grant
    write_atomically(path, "0.5")
    now_s[0] += 0.01
    assert reader.sm_frac() is None  # within poll_s of the last look: cached
    now_s[0] += 0.05
    assert reader.sm_frac() == 0.5
    write_atomically(path, "0.25\n")
    now_s[0] += 0.06
    assert reader.sm_frac() == 0.25
    write_atomically(path, "0.2x")  # garbage: keep the last good value
    now_s[0] += 0.06
    assert reader.sm_frac() == 0.25
    for text, want in (("7", 1.0), ("0", None), ("inf", None)):
        write_atomically(path, text)
        now_s[0] += 0.06
        assert reader.sm_frac() == want, text
    os.unlink(path)
    now_s[0] += 0.06
    assert reader.sm_frac() is None


class FakeModelRunner:
    def __init__(self, fail: bool = False):
        self.fail = fail
        self.calls: list[int] = []

    def update_decode_attn_backend(self, stream_idx):
        self.calls.append(stream_idx)
        if self.fail and len(self.calls) == 1:
            raise IndexError("no backend for that group")


@dataclass
class FakeTpWorker:
    model_runner: FakeModelRunner


@dataclass
class FakePdmuxScheduler:
    tp_worker: FakeTpWorker
    sm_counts: list = field(default_factory=lambda: list(SM_COUNTS))
    stream_groups: list = field(default_factory=lambda: [(f"prefill{i}", f"decode{i}") for i in range(5)])


def pdmux_case(short_dir, grant: str | None, fail: bool = False):
    path = os.path.join(short_dir, "grant")
    if grant is not None:
        write_atomically(path, grant)
    set_calls: list[int] = []
    hook = make_adjust_stream_groups_hook(GrantReader(path), set_stream_idx=set_calls.append)
    return hook, FakePdmuxScheduler(FakeTpWorker(FakeModelRunner(fail))), set_calls


def sglang_choice(idx):
    return lambda sched: (idx, sched.stream_groups[idx])


def test_pdmux_grant_overrides_the_decode_group(short_dir):
    hook, sched, set_calls = pdmux_case(short_dir, "0.5")
    assert hook(sglang_choice(4), sched) == (3, ("prefill3", "decode3"))
    assert set_calls == [3] and sched.tp_worker.model_runner.calls == [3]


@pytest.mark.parametrize("grant, original_idx", [(None, 4), ("0.5", 0), ("0.5", 3)],
                         ids=["no-grant", "prefill-only", "already-right"])
def test_pdmux_keeps_sglang_choice(short_dir, grant, original_idx):
    hook, sched, set_calls = pdmux_case(short_dir, grant)
    assert hook(sglang_choice(original_idx), sched) == (original_idx, sched.stream_groups[original_idx])
    assert set_calls == [] and sched.tp_worker.model_runner.calls == []


def test_pdmux_failed_switch_restores_sglang_choice(short_dir):
    hook, sched, set_calls = pdmux_case(short_dir, "0.5", fail=True)
    assert hook(sglang_choice(4), sched) == (4, ("prefill4", "decode4"))
    assert set_calls == [3, 4] and sched.tp_worker.model_runner.calls == [3, 4]


def test_pdmux_sglang_errors_pass_through(short_dir):
    hook, sched, _ = pdmux_case(short_dir, "0.5")
    err = ValueError("Invalid stream index: 9")

    def failing(sched):
        raise err

    with pytest.raises(ValueError) as info:
        hook(failing, sched)
    assert info.value is err


# ---------------------------------------------------- SGLang's own HookRegistry, from the wheel, on a fake Scheduler


def test_real_hook_registry_wires_the_hook(wheel, sink, monkeypatch):
    # hook_registry.py needs only the standard library, so it runs here even though `import sglang` cannot.
    for name in ("sglang", "sglang.srt", "sglang.srt.plugins", "sglang.srt.managers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    registry = types.ModuleType("sglang.srt.plugins.hook_registry")
    with zipfile.ZipFile(wheel) as zf:
        exec(compile(zf.read("sglang/srt/plugins/hook_registry.py"), "hook_registry.py", "exec"), registry.__dict__)
    monkeypatch.setitem(sys.modules, registry.__name__, registry)

    class Scheduler(FakeScheduler):
        def run_batch(self, batch, pp_proxy_tensors=None):
            return ("result", batch)

    scheduler_module = types.ModuleType("sglang.srt.managers.scheduler")
    scheduler_module.Scheduler = Scheduler
    monkeypatch.setitem(sys.modules, scheduler_module.__name__, scheduler_module)

    environ = {"JIGSAW_ENABLE": "1", "JIGSAW_FORWARD_SOCK": sink.path, "JIGSAW_REPLICA": "4"}
    assert plugin.load(environ=environ) == (plugin.RUN_BATCH_TARGET,)
    registry.HookRegistry.apply_hooks()
    assert Scheduler.run_batch.__wrapped__ is not None
    batch = FakeBatch(FakeForwardMode.MIXED, extend_num_tokens=130, decoding_reqs=[1, 2], reqs=[1, 2, 3])
    assert Scheduler().run_batch(batch) == ("result", batch)
    Scheduler().run_batch(MARKER)
    assert until_marker(sink) == [(4, 128, 2)]
