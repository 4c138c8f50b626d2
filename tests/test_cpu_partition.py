"""CPU partitions: core splits, the partitioner's descriptors, binding a process."""

import os

import pytest

from jigsaw.mux.cpu import CpuPartitioner, CpuSlice, apply_slice, cpu_levels, split_cores


def test_levels_are_shares_a_core_split_can_give():
    assert cpu_levels(2) == (0.5, 1.0)
    assert cpu_levels(4) == (0.25, 0.5, 0.75, 1.0)
    assert cpu_levels(16) == (0.0625, 0.5, 0.9375, 1.0)


def test_split_cores_is_disjoint_and_never_empty():
    assert split_cores((0, 1), 0.25) == ((0,), (1,))
    assert split_cores(tuple(range(8)), 0.75) == ((0, 1, 2, 3, 4, 5), (6, 7))
    for n in range(2, 9):
        for frac in (0.1, 0.25, 0.5, 0.75, 0.9):
            a, b = split_cores(tuple(range(n)), frac)
            assert a and b and not set(a) & set(b) and len(a) + len(b) == n
    with pytest.raises(ValueError, match="cannot split 1"):
        split_cores((0,), 0.5)


def test_partitioner_descriptors():
    p = CpuPartitioner(num_devices=2, cores=(0, 1, 2, 3))
    assert p.apply(1, {"a": 1.0}) == {"a": {"kind": "cpu", "cores": "2,3", "threads": "2"}}
    pair = p.apply(0, {"a": 0.5, "b": 0.5, "r": 0.0})
    assert {CpuSlice.parse(pair[s]).cores for s in "ab"} == {(0,), (1,)} and pair["r"] == {"kind": "host"}
    shared = p.apply(0, {"a": 1.0, "b": 1.0})
    assert CpuSlice.parse(shared["a"]).cores == CpuSlice.parse(shared["b"]).cores == (0, 1)
    with pytest.raises(ValueError, match="at most 2"):
        p.apply(0, {"a": 0.25, "b": 0.25, "c": 0.5})
    with pytest.raises(ValueError, match="cannot make"):
        CpuPartitioner(num_devices=3, cores=(0, 1))


def test_apply_slice_binds_every_thread_of_this_process():
    import threading

    import torch

    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)  # a thread that exists before the binding
    other.start()
    try:
        core = min(before)
        apply_slice(CpuSlice(cores=(core,), num_threads=1))
        assert os.sched_getaffinity(0) == {core} and torch.get_num_threads() == 1
        assert os.sched_getaffinity(other.native_id) == {core}
    finally:
        stop.set()
        other.join()
        apply_slice(CpuSlice(cores=tuple(sorted(before)), num_threads=threads))
