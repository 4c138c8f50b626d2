"""Green-context partitions and per-budget CUDA graphs (jigsaw.mux.partition: green_probe, green, cudagraphs).

CPU tests cover the rounding rule, the failure paths on a machine without a GPU, and the
shared bookkeeping through an in-memory driver whose SM resources are sets of SM ids (so an
overlap between two sides is visible).  `gpu` tests need a CUDA device and skip without one.
"""

from __future__ import annotations

import contextlib
import enum
import gc
import itertools
import math
import subprocess
import sys
import weakref
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jigsaw.mux.partition import cudagraphs, green_probe
from jigsaw.mux.partition.bind import Binder
from jigsaw.mux.partition.cudagraphs import BudgetGraphs, GraphMemory, GraphNotCapturedError
from jigsaw.mux.partition.green import GreenPartitions, Partition
from jigsaw.mux.partition.green_probe import GreenContextError, probe, probe_resource
from jigsaw.mux.partition.partitioners import Green, GreenPartitioner
from jigsaw.mux.partition.smsplit import SmResource, assign_sides, budget_grid, granularity, split_sms

HOPPER = SmResource(num_sms=132, min_partition_sms=8, alignment_sms=8)
A100 = SmResource(num_sms=108, min_partition_sms=4, alignment_sms=2)
VOLTA = SmResource(num_sms=80, min_partition_sms=2, alignment_sms=2)
LEVELS = (0.25, 0.5, 0.75)


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


no_gpu_here = pytest.mark.skipif(_has_cuda(), reason="checks the failure path of a machine without a GPU")


def _gpu_torch():
    """torch (a `gpu` test: conftest skips it without CUDA)."""
    import torch

    return torch


def _valid(resource: SmResource, n: int) -> bool:
    return n >= resource.min_partition_sms and n % resource.alignment_sms == 0


# ---------------------------------------------------------------------------------------
# granularity and rounding


@pytest.mark.parametrize("cc,expected", [((6, 0), (1, 1)), ((6, 1), (1, 1)), ((7, 0), (2, 2)), ((7, 5), (2, 2)),
                                         ((8, 0), (4, 2)), ((8, 9), (4, 2)), ((9, 0), (8, 8)), ((10, 0), (8, 8)),
                                         ((12, 0), (8, 8))])
def test_granularity_table(cc, expected):
    assert granularity(cc) == expected


def test_granularity_refuses_pre_pascal():
    with pytest.raises(ValueError, match="compute capability >= 6.0"):
        granularity((5, 2))


@pytest.mark.parametrize("resource,grid", [
    (HOPPER, {0.25: (32, 96), 0.5: (64, 64), 0.75: (96, 32)}),
    (A100, {0.25: (28, 80), 0.5: (54, 54), 0.75: (80, 28)}),  # 27 SMs: tie 26 | 28 -> 28
    (VOLTA, {0.25: (20, 60), 0.5: (40, 40), 0.75: (60, 20)}),
], ids=["hopper-132", "a100-108", "volta-80"])
def test_budget_grid_on_known_devices(resource, grid):
    got = budget_grid(resource, LEVELS)
    assert got == grid
    for a, b in got.values():
        assert _valid(resource, a) and _valid(resource, b)
        assert a + b <= resource.num_sms
        assert resource.num_sms - a - b < resource.alignment_sms


def test_hopper_leftover_goes_to_neither_side():
    for frac in LEVELS:
        a, b = split_sms(HOPPER, frac)
        assert a % 8 == 0 and b % 8 == 0 and a >= 8 and b >= 8
        assert 132 - a - b == 4  # 132 is not a multiple of 8


def test_h20_78_sms():
    h20 = SmResource(num_sms=78, min_partition_sms=8, alignment_sms=8)
    assert budget_grid(h20) == {0.25: (16, 56), 0.5: (40, 32), 0.75: (56, 16)}


@pytest.mark.parametrize("resource", [SmResource(num_sms=15, min_partition_sms=8, alignment_sms=8),
                                      SmResource(num_sms=7, min_partition_sms=4, alignment_sms=2),
                                      SmResource(num_sms=1, min_partition_sms=1, alignment_sms=1)])
def test_device_too_small_for_two_partitions(resource):
    with pytest.raises(ValueError, match="cannot hold two green-context partitions"):
        split_sms(resource, 0.5)


def test_smallest_device_that_holds_two():
    assert split_sms(SmResource(num_sms=16, min_partition_sms=8, alignment_sms=8), 0.25) == (8, 8)
    assert split_sms(SmResource(num_sms=8, min_partition_sms=4, alignment_sms=2), 0.9) == (4, 4)


@pytest.mark.parametrize("frac", [0.0, 1.0, -0.25, 1.5, math.nan, math.inf, True, "0.5"])
def test_split_refuses_a_frac_outside_0_1(frac):
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        split_sms(HOPPER, frac)


@pytest.mark.parametrize("kwargs", [{"num_sms": 0, "min_partition_sms": 8, "alignment_sms": 8},
                                    {"num_sms": 132, "min_partition_sms": 0, "alignment_sms": 8},
                                    {"num_sms": 132, "min_partition_sms": 8, "alignment_sms": 2.0}])
def test_sm_resource_validates(kwargs):
    with pytest.raises(ValueError, match="positive int"):
        SmResource(**kwargs)


_CCS = [(6, 0), (7, 0), (8, 0), (8, 6), (9, 0), (10, 0)]


@settings(max_examples=400, deadline=None)
@given(num_sms=st.integers(1, 300), cc=st.sampled_from(_CCS),
       frac=st.floats(1e-6, 1.0 - 1e-6))
def test_split_property(num_sms, cc, frac):
    min_sms, step = granularity(cc)
    r = SmResource(num_sms=num_sms, min_partition_sms=min_sms, alignment_sms=step)
    lo = -(-min_sms // step) * step
    if num_sms < 2 * lo:
        with pytest.raises(ValueError):
            split_sms(r, frac)
        return
    a, b = split_sms(r, frac)
    assert _valid(r, a) and _valid(r, b)
    assert a + b <= num_sms and num_sms - a - b < step
    small = a if frac <= 0.5 else b
    target = min(frac, 1 - frac) * num_sms
    feasible = [c for c in range(lo, num_sms - lo + 1, step)]
    assert all(abs(c - target) >= abs(small - target) - 1e-9 for c in feasible)  # nearest
    if abs(frac - 0.5) > 1e-12:
        assert split_sms(r, 1 - frac) == (b, a)  # mirror-symmetric


# ---------------------------------------------------------------------------------------
# this machine: no GPU, CPU torch


@no_gpu_here
def test_probe_here_names_the_cause():
    import torch

    with pytest.raises(GreenContextError) as info:
        probe()
    if torch.version.cuda is None:
        assert info.value.cause == "torch-no-cuda"
        assert "without CUDA" in str(info.value)
    else:
        assert info.value.cause in ("no-driver", "torch-cuda-unavailable", "no-device")


@no_gpu_here
def test_probe_without_libcuda_says_driver_not_found(monkeypatch):
    pytest.importorskip("cuda.bindings.driver")
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")  # get past the torch check to the driver
    with pytest.raises(GreenContextError) as info:
        probe(0)
    assert info.value.cause == "no-driver"
    assert "libcuda" in str(info.value) and "NVIDIA driver" in str(info.value)


@no_gpu_here
def test_probe_does_not_crash_or_hang():
    code = ("from jigsaw.mux.partition.green_probe import probe, GreenContextError\n"
            "try:\n    probe(0)\nexcept GreenContextError as e:\n    print('REFUSED', e.cause)\n")
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("REFUSED ")


@no_gpu_here
def test_green_partitions_and_graphs_refuse_here():
    with pytest.raises(GreenContextError):
        GreenPartitions()
    with pytest.raises(GreenContextError, match="CUDA"):
        BudgetGraphs({1.0: Partition(frac=1.0, num_sms=132, stream=None)})


def test_import_does_not_import_torch_or_cuda():
    code = ("import sys, jigsaw.mux.partition.green, jigsaw.mux.partition.cudagraphs\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.split('.')[0] == 'cuda'))\n")
    res = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_bad_device_index_is_refused_first():
    for device in (-1, True, 1.0):
        with pytest.raises(GreenContextError) as info:
            probe(device)
        assert info.value.cause == "bad-device"


# ---------------------------------------------------------------------------------------
# an in-memory driver: the real call shapes, SM resources as sets of SM ids


class FakeResult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION = 915


OK = FakeResult.CUDA_SUCCESS


@dataclass
class FakeSm:
    smCount: int
    minSmPartitionSize: int
    smCoscheduledAlignment: int


@dataclass
class FakeRes:
    sm: FakeSm
    ids: frozenset


class FakeDriver:
    """cuda.bindings.driver look-alike.  Splits hand out the lowest free SM ids, so two
    separate splits of the device overlap, as the real driver allows them to."""

    CUdevice_attribute = SimpleNamespace(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR=75,
                                         CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR=76)
    CUdevResourceType = SimpleNamespace(CU_DEV_RESOURCE_TYPE_SM=1)
    CUgreenCtxCreate_flags = SimpleNamespace(CU_GREEN_CTX_DEFAULT_STREAM=1)
    CUstream_flags = SimpleNamespace(CU_STREAM_NON_BLOCKING=1)

    def __init__(self, *, num_sms=132, cc=(9, 0), version=13040, devices=1, fail_create_at=None):
        self.num_sms, self.cc, self.version, self.devices = num_sms, cc, version, devices
        self.min, self.align = {6: (1, 1), 7: (2, 2), 8: (4, 2)}.get(cc[0], (8, 8))
        self.fail_create_at = fail_create_at
        self.contexts: dict[int, frozenset] = {}
        self.streams: dict[int, int] = {}
        self.ctx_stack: list = []
        self.splits = self.creates = 0
        self._ids = itertools.count(1000)

    @staticmethod
    def CU_DEV_SM_RESOURCE_GROUP_PARAMS():
        return SimpleNamespace(smCount=0, coscheduledSmCount=0, preferredCoscheduledSmCount=0, flags=0)

    def _res(self, ids):
        return FakeRes(sm=FakeSm(len(ids), self.min, self.align), ids=frozenset(ids))

    def cuInit(self, flags):
        return (OK,)

    def cuDriverGetVersion(self):
        return (OK, self.version)

    def cuDeviceGetCount(self):
        return (OK, self.devices)

    def cuDeviceGet(self, i):
        return (OK, i) if 0 <= i < self.devices else (FakeResult.CUDA_ERROR_INVALID_DEVICE, None)

    def cuDeviceGetAttribute(self, attr, dev):
        return (OK, self.cc[0] if attr == 75 else self.cc[1])

    def cuDeviceGetName(self, length, dev):
        return (OK, b"Fake H100" + b"\0" * (length - 9))

    def cuDeviceGetDevResource(self, dev, kind):
        return (OK, self._res(range(self.num_sms)))

    def cuDevSmResourceSplit(self, n, whole, flags, params):
        assert self.version >= 13010, "no structured split before 13.1"
        self.splits += 1
        free, out = sorted(whole.ids), []
        for p in params[:n]:
            if p.smCount % 2 or p.smCount > len(free):
                return (FakeResult.CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION, None, None)
            out.append(self._res(free[:p.smCount]))
            free = free[p.smCount:]
        return (OK, out, self._res(free))

    def cuDevSmResourceSplitByCount(self, n, whole, flags, min_count):
        self.splits += 1
        count = -(-max(min_count, self.min) // self.align) * self.align
        free = sorted(whole.ids)
        made = min(n, len(free) // count)
        out = [self._res(free[i * count:(i + 1) * count]) for i in range(made)]
        return (OK, out, made, self._res(free[made * count:]))

    def cuDevResourceGenerateDesc(self, resources, n):
        return (OK, frozenset().union(*(r.ids for r in resources[:n])))

    def cuGreenCtxCreate(self, desc, dev, flags):
        self.creates += 1
        if self.creates == self.fail_create_at:
            return (FakeResult.CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION, None)
        handle = next(self._ids)
        self.contexts[handle] = desc
        return (OK, handle)

    def cuGreenCtxGetDevResource(self, ctx, kind):
        return (OK, self._res(self.contexts[ctx]))

    def cuGreenCtxStreamCreate(self, ctx, flags, priority):
        if self.version < 12050:
            raise RuntimeError("Function cuGreenCtxStreamCreate not found")  # as the bindings say
        return self._new_stream(ctx)

    def _new_stream(self, ctx):
        handle = next(self._ids)
        self.streams[handle] = ctx
        return (OK, handle)

    def cuCtxFromGreenCtx(self, ctx):
        return (OK, ("primary-of", ctx))

    def cuCtxPushCurrent(self, ctx):
        self.ctx_stack.append(ctx)
        return (OK,)

    def cuCtxPopCurrent(self):
        return (OK, self.ctx_stack.pop())

    def cuStreamCreate(self, flags):
        return self._new_stream(self.ctx_stack[-1][1])

    def cuStreamSynchronize(self, stream):
        return (OK,) if stream in self.streams else (FakeResult.CUDA_ERROR_INVALID_HANDLE,)

    def cuStreamDestroy(self, stream):
        return (OK,) if self.streams.pop(stream, None) is not None else (FakeResult.CUDA_ERROR_INVALID_HANDLE,)

    def cuGreenCtxDestroy(self, ctx):
        if ctx not in self.contexts or any(c == ctx for c in self.streams.values()):
            return (FakeResult.CUDA_ERROR_INVALID_HANDLE,)  # unknown, or streams still alive
        del self.contexts[ctx]
        return (OK,)


class FakeStream:
    def __init__(self, ptr=0, device=None):
        self.ptr, self.device = ptr, device

    def synchronize(self):
        pass


def fake_torch(green_contexts=None):
    cuda = SimpleNamespace(is_available=lambda: True, device_count=lambda: 1,
                           device=lambda d: contextlib.nullcontext(), synchronize=lambda *a, **k: None,
                           Stream=lambda device=None: FakeStream(0, device), ExternalStream=FakeStream,
                           green_contexts=green_contexts or SimpleNamespace(SUPPORTED=False))
    return SimpleNamespace(__version__="0.0+fake", version=SimpleNamespace(cuda="13.0"), cuda=cuda)


@pytest.fixture
def fake(monkeypatch):
    def install(drv=None, torch=None):
        drv = drv or FakeDriver()
        torch = torch or fake_torch()
        monkeypatch.setattr(green_probe, "_import_driver", lambda: drv)
        monkeypatch.setattr(green_probe, "_import_torch", lambda: torch)
        return drv
    return install


def _ids(drv: FakeDriver, part: Partition) -> frozenset:
    return drv.contexts[drv.streams[part.stream.ptr]]


def test_check_maps_cu_results():
    assert green_probe._check((OK, 7), "x") == 7
    assert green_probe._check((OK, 1, 2), "x") == (1, 2)
    assert green_probe._check((OK,), "x") is None
    for code, cause in [(FakeResult.CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION, "insufficient-sms"),
                        (FakeResult.CUDA_ERROR_INVALID_DEVICE, "bad-device"),
                        (FakeResult.CUDA_ERROR_INVALID_HANDLE, "driver-error")]:
        with pytest.raises(GreenContextError, match=f"cuX failed with {code.name} \\({int(code)}\\)") as info:
            green_probe._check((code, None), "cuX")
        assert info.value.cause == cause


def test_probe_with_a_driver(fake):
    fake(FakeDriver(version=13040))
    s = probe(0)
    assert (s.backend, s.driver_version, s.device, s.name, s.compute_capability) == \
        ("cuda-python", 13040, 0, "Fake H100", (9, 0))
    assert s.resource == HOPPER


@pytest.mark.parametrize("drv,device,cause,words", [
    (FakeDriver(version=12020), 0, "driver-too-old", ["12.2", "12020", "12.4", "12.5"]),
    (FakeDriver(devices=2), 3, "bad-device", ["device 3", "2 device"]),
    (FakeDriver(cc=(5, 2)), 0, "unsupported-device", ["5.2", ">= 6.0"]),
], ids=["old-driver", "bad-index", "maxwell"])
def test_probe_refusals(fake, drv, device, cause, words):
    fake(drv)
    with pytest.raises(GreenContextError) as info:
        probe(device)
    assert info.value.cause == cause
    for word in words:
        assert word in str(info.value)


def test_probe_picks_torch_only_with_a_split_api(fake):
    torch_gc = SimpleNamespace(SUPPORTED=True, SMPartition=SimpleNamespace(split=None))
    fake(FakeDriver(version=13040), fake_torch(torch_gc))
    assert probe().backend == "torch"
    fake(FakeDriver(version=12080), fake_torch(torch_gc))  # torch's floor, but no structured split
    assert probe().backend == "cuda-python"
    fake(FakeDriver(version=13040), fake_torch(SimpleNamespace(SUPPORTED=True)))  # create(num_sms) only
    assert probe().backend == "cuda-python"
    fake(FakeDriver(version=13040, cc=(6, 1)), fake_torch(torch_gc))  # odd counts: no structured split
    assert probe().backend == "cuda-python"


def test_pairs_come_from_one_split_each_and_are_disjoint(fake):
    drv = fake(FakeDriver(version=13040))
    with GreenPartitions(0, LEVELS) as parts:
        assert parts.fracs == LEVELS and parts.support.backend == "cuda-python"
        assert drv.splits == 2 and len(drv.contexts) == 4  # {0.25, 0.75} share one split
        for frac, expected in budget_grid(HOPPER, LEVELS).items():
            a, b = parts.pair(frac)
            assert (a.frac, b.frac) == (frac, 1 - frac)
            assert (a.num_sms, b.num_sms) == expected
            assert not _ids(drv, a) & _ids(drv, b)
        assert parts.pair(0.75) == parts.pair(0.25)[::-1]
        assert parts.full.num_sms == 132 and parts.full.frac == 1.0
        assert set(parts.by_budget()) == {0.25, 0.5, 0.75, 1.0}
        with pytest.raises(ValueError, match="no partition pair for budget 0.3"):
            parts.pair(0.3)
    assert drv.contexts == {} and drv.streams == {}
    parts.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        parts.pair(0.25)


def test_driver_12_4_splits_by_count_and_makes_streams_inside(fake):
    drv = fake(FakeDriver(version=12040))
    with GreenPartitions(0, (0.25,)) as parts:
        assert parts.fracs == (0.25, 0.75)
        a, b = parts.pair(0.25)
        assert (a.num_sms, b.num_sms) == (32, 100)  # the remainder keeps the 4 leftover SMs
        assert not _ids(drv, a) & _ids(drv, b) and len(_ids(drv, a) | _ids(drv, b)) == 132
        assert drv.ctx_stack == []  # every push popped
    assert drv.contexts == {} and drv.streams == {}


def test_a_failed_create_destroys_what_was_made(fake):
    drv = fake(FakeDriver(version=13040, fail_create_at=3))
    with pytest.raises(GreenContextError) as info:
        GreenPartitions(0, LEVELS)
    assert info.value.cause == "insufficient-sms"
    assert drv.creates == 3 and drv.contexts == {} and drv.streams == {}


def test_a_device_too_small_is_a_green_context_error(fake):
    drv = fake(FakeDriver(num_sms=12))
    with pytest.raises(GreenContextError, match="cannot hold two") as info:
        GreenPartitions()
    assert info.value.cause == "insufficient-sms" and drv.contexts == {}


class FakeSMPartition:
    def __init__(self, ids, device):
        self.ids, self.device_id = ids, device

    @classmethod
    def from_device(cls, device_id):
        return cls(tuple(range(132)), device_id)

    def split(self, *, num_sms):
        free, out = list(self.ids), []
        for n in num_sms:
            out.append(FakeSMPartition(tuple(free[:n]), self.device_id))
            free = free[n:]
        return tuple(out), FakeSMPartition(tuple(free), self.device_id)


class FakeGreenContext:
    def __init__(self, *, sm_partition):
        self.sm_count, self.ids = len(sm_partition.ids), frozenset(sm_partition.ids)

    def Stream(self):
        return FakeStream(id(self))


def test_torch_backend_pairs_and_close(fake):
    gc_mod = SimpleNamespace(SUPPORTED=True, SMPartition=FakeSMPartition, GreenContext=FakeGreenContext)
    fake(FakeDriver(version=13040), fake_torch(gc_mod))
    parts = GreenPartitions(0, LEVELS)
    assert parts.support.backend == "torch"
    sides = [s for s in parts._sides]
    refs = [weakref.ref(s.handle) for s in sides]
    for frac in (0.25, 0.5):
        a, b = parts.pair(frac)
        assert (a.num_sms, b.num_sms) == split_sms(HOPPER, frac)
    pairs = [(s0, s1) for s0, s1 in zip(sides[::2], sides[1::2])]
    assert all(not p.handle.ids & q.handle.ids for p, q in pairs)
    del sides, pairs
    parts.close()
    gc.collect()
    assert all(r() is None for r in refs)  # torch destroys a GreenContext when it is collected


# ---------------------------------------------------------------------------------------
# the daemon's partitioner


def test_assign_sides_layouts():
    levels = (0.25, 0.5, 0.75)
    assert assign_sides({"a": 0.25, "b": 0.75}, levels) == {"a": (0.25, 0), "b": (0.75, 0)}
    assert assign_sides({"b": 0.5, "a": 0.5}, levels) == {"a": (0.5, 0), "b": (0.5, 1)}
    assert assign_sides({"a": 1.0}, levels) == {"a": (1.0, 0)}
    assert assign_sides({"a": 0.25}, levels) == {"a": (0.25, 0)}  # partner ended first
    assert assign_sides({"a": 0.7500000001, "b": 0.25, "r": 0.0}, levels) == \
        {"a": (0.75, 0), "b": (0.25, 0), "r": (0.0, 0)}
    assert assign_sides({}, levels) == {}


@pytest.mark.parametrize("budgets,match", [
    ({"a": 0.3, "b": 0.7}, "not a level"),
    ({"a": 0.25, "b": 0.5}, "not a pair"),
    ({"a": 0.25, "b": 0.25, "c": 0.5}, "not a pair"),
    ({"a": 1.0, "b": 1.0}, "not a pair"),
    ({"a": 0.4}, "not a level"),
    ({"a": 1.2}, r"must lie in \[0, 1\]"),
    ({"a": math.nan}, r"must lie in \[0, 1\]"),
])
def test_assign_sides_refuses(budgets, match):
    with pytest.raises(ValueError, match=match):
        assign_sides(budgets, (0.25, 0.5, 0.75))


def test_partitioner_descriptors_are_pure():
    p = GreenPartitioner(LEVELS, resource=HOPPER)
    got = p.partitions(0, (("a", 0.25), ("b", 0.75)))
    assert got == {"a": Green(num_sms=32, budget=0.25, side=0, levels=LEVELS),
                   "b": Green(num_sms=96, budget=0.75, side=0, levels=LEVELS)}
    halves = p.partitions(0, (("x", 0.5), ("y", 0.5)))
    assert (halves["x"].side, halves["y"].side) == (0, 1) and halves["y"].num_sms == 64
    assert p.partitions(0, (("a", 1.0),)) == {"a": Green(num_sms=132, budget=1.0, side=0, levels=LEVELS)}
    h20 = GreenPartitioner(LEVELS, resource=SmResource(num_sms=78, min_partition_sms=8, alignment_sms=8))
    assert [h20.partitions(0, (("x", 0.5), ("y", 0.5)))[k].num_sms for k in "xy"] == [40, 32]  # sides differ
    with pytest.raises(ValueError, match="not a level"):
        p.partitions(0, (("a", 0.3), ("b", 0.7)))


def test_the_daemon_reads_the_sm_resource_from_the_driver_alone(fake):
    fake(FakeDriver(version=13040), torch=SimpleNamespace())  # a torch without cuda would raise if used
    assert probe_resource(0) == HOPPER
    assert GreenPartitioner(LEVELS, device=0).resource == HOPPER


@no_gpu_here
def test_without_a_driver_the_green_partitioner_cannot_start():
    with pytest.raises(GreenContextError):
        GreenPartitioner(LEVELS)


def test_bind_opens_the_partitions_once_and_returns_the_granted_side(fake):
    drv = fake(FakeDriver(version=13040))
    binder = Binder(device=0)
    a = binder.bind(Green(num_sms=32, budget=0.25, side=0, levels=LEVELS))
    b = binder.bind(Green(num_sms=96, budget=0.75, side=0, levels=LEVELS))
    assert (a.green.num_sms, b.green.num_sms) == (32, 96) and a.budget == 0.25
    assert not _ids(drv, a.green) & _ids(drv, b.green)  # the two sides of one split
    assert a.stream is a.green.stream and drv.splits == 2 and len(drv.contexts) == 4  # opened once
    whole = binder.bind(Green(num_sms=132, budget=1.0, side=0, levels=LEVELS))
    assert whole.green.num_sms == 132 and whole.budget == 1.0
    x = binder.bind(Green(num_sms=64, budget=0.5, side=0, levels=LEVELS))
    y = binder.bind(Green(num_sms=64, budget=0.5, side=1, levels=LEVELS))
    assert not _ids(drv, x.green) & _ids(drv, y.green) and drv.splits == 2  # no new split
    binder.close()
    assert drv.contexts == {} and drv.streams == {}


# ---------------------------------------------------------------------------------------
# per-budget graphs: bookkeeping that does not reach the device


def test_budget_graphs_refuse_an_uncaptured_key(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(cudagraphs, "require_torch_cuda", lambda device=0: torch)
    graphs = BudgetGraphs({0.25: Partition(frac=0.25, num_sms=32, stream=None)})
    with pytest.raises(GraphNotCapturedError, match=r"batch size 8; captured: none"):
        graphs.replay(0.25, 8)
    with pytest.raises(GraphNotCapturedError, match="no graphs for budget 0.5"):
        graphs.replay(0.5, 8)
    with pytest.raises(ValueError, match="has no partition"):
        graphs.capture(lambda n: None, [8], budgets=[0.5])
    assert graphs.memory_by_budget() == {0.25: GraphMemory()} and graphs.total_memory() == GraphMemory()
    graphs.close()
    graphs.close()


def test_graph_memory_adds_up():
    a = GraphMemory(pool_bytes=1, live_bytes=2, device_bytes=3)
    assert a + a == GraphMemory(pool_bytes=2, live_bytes=4, device_bytes=6)


# ---------------------------------------------------------------------------------------
# on a GPU


@pytest.mark.gpu
def test_gpu_real_split_on_device_0():
    _gpu_torch()
    support = probe(0)
    n = support.resource.num_sms
    with GreenPartitions(0, LEVELS) as parts:
        for frac in LEVELS:
            a, b = parts.pair(frac)
            want = split_sms(support.resource, frac)
            assert a.num_sms + b.num_sms <= n
            if support.driver_version >= green_probe.STRUCTURED_SPLIT_MIN_DRIVER:
                assert (a.num_sms, b.num_sms) == want
            else:  # split by count: the smaller side as rounded, the remainder for the other
                small = min(range(2), key=lambda i: want[i])
                assert (a.num_sms, b.num_sms)[small] == want[small]
                assert a.num_sms + b.num_sms == n


@pytest.mark.gpu
def test_gpu_work_on_a_partition_stream_completes():
    torch = _gpu_torch()
    with GreenPartitions(0, (0.25,)) as parts:
        x = torch.randn(512, 512, device="cuda")
        want = x @ x
        torch.cuda.synchronize()
        for side in parts.pair(0.25):
            with torch.cuda.stream(side.stream):
                got = x @ x
            side.stream.synchronize()
            torch.testing.assert_close(got, want)


@pytest.mark.gpu
def test_gpu_graph_per_budget_replays_like_eager():
    torch = _gpu_torch()
    max_batch, dim = 16, 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(dim, dim, device="cuda", generator=gen) / dim ** 0.5 for _ in range(3)]
    static_in = torch.zeros(max_batch, dim, device="cuda")

    def chain(batch_size: int):
        h = static_in[:batch_size]
        for w in weights:
            h = torch.relu(h @ w)
        return h

    with GreenPartitions(0, LEVELS) as parts, BudgetGraphs(parts.by_budget()) as graphs:
        graphs.capture(chain, [4, 16])
        assert len(graphs.captured) == 4 * 2
        for budget, batch_size in graphs.captured:
            static_in.copy_(torch.randn(max_batch, dim, device="cuda", generator=gen))
            want = chain(batch_size).clone()
            got = graphs.replay(budget, batch_size)
            torch.testing.assert_close(got, want)
        per_budget = graphs.memory_by_budget()
        assert set(per_budget) == {0.25, 0.5, 0.75, 1.0}
        total = graphs.total_memory()
        assert total.pool_bytes == sum(m.pool_bytes for m in per_budget.values()) and total.pool_bytes >= 0
        with pytest.raises(GraphNotCapturedError):
            graphs.replay(0.25, 8)


@pytest.mark.gpu
def test_gpu_bind_runs_work_on_the_granted_sms_only():
    """The worker-side bind on a GPU: each side of a pair, bound in this process, keeps its
    kernels on its own SMs (the SM-id census of jigsaw.mux.partition.smid)."""
    torch = _gpu_torch()
    from jigsaw.mux.partition.smid import sm_ids

    resource = probe(0).resource
    daemon = GreenPartitioner(LEVELS, resource=resource)
    binder = Binder(device=0)
    try:
        for frac in LEVELS:
            layout = daemon.partitions(0, (("a", frac), ("b", round(1 - frac, 9))))
            seen = []
            for sid in "ab":
                bound = binder.bind(layout[sid])
                ids = sm_ids(4 * resource.num_sms, stream=bound.stream)
                torch.cuda.synchronize()
                assert len(ids) <= bound.green.num_sms
                seen.append(set(ids))
            assert not seen[0] & seen[1]
    finally:
        binder.close()


@pytest.mark.gpu
def test_gpu_create_and_close_twice():
    torch = _gpu_torch()
    for _ in range(2):
        parts = GreenPartitions(0, LEVELS)
        with torch.cuda.stream(parts.pair(0.5)[1].stream):
            total = torch.ones(1024, device="cuda").sum()
        torch.cuda.synchronize()
        assert total.item() == 1024
        parts.close()
        parts.close()  # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            parts.pair(0.5)
