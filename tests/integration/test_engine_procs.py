"""A CPU pipeline's start-up: engine processes start from a fork server that imported torch once
(jigsaw/engines/procs.py), yet each sees what a spawned process would (the caller's environment
and cores at start); the recipe's own process loads a tokenizer, not the model."""

from __future__ import annotations

import os
import subprocess
import sys
from multiprocessing.connection import Pipe

import pytest

from jigsaw.engines import forkserver_exit, procs


def _report(conn, names: list[str]) -> None:
    """In the child: what it inherited, before it imports anything itself."""
    conn.send({"env": os.environ.get("JIGSAW_TEST_PROCS"), "cores": sorted(os.sched_getaffinity(0)),
               "preloaded": [n for n in names if n in sys.modules], "pid": os.getpid(),
               "quick_exit": sys.modules["jigsaw.engines.forkserver_exit"].ARMED,
               "mark": os.environ.get(forkserver_exit.MARK)})
    conn.close()


def _start(names=procs.PRELOAD) -> dict:
    parent, child = Pipe()
    proc = procs.process(_report, (child, list(names)), name="jigsaw-test-procs")
    proc.start()
    child.close()
    assert parent.poll(120), "the engine process did not report in 120 s"
    got = parent.recv()
    proc.join(30)
    assert proc.exitcode == 0
    return got


@pytest.mark.timeout(300)
def test_an_engine_process_has_torch_already_and_the_callers_environment_and_cores_of_now(monkeypatch):
    procs.warm()  # the server starts with the environment and cores of this moment ...
    first = _start()
    assert first["env"] is None and first["pid"] != os.getpid()
    assert first["preloaded"] == list(procs.PRELOAD)  # imported in the server, not again per process
    monkeypatch.setenv("JIGSAW_TEST_PROCS", "set after the server started")  # ... both change later
    cores = sorted(os.sched_getaffinity(0))
    try:
        if len(cores) > 1:
            os.sched_setaffinity(0, cores[:1])
        later = _start()
    finally:
        os.sched_setaffinity(0, cores)
    assert later["env"] == "set after the server started"
    assert later["cores"] == (cores[:1] if len(cores) > 1 else cores)


def test_only_the_fork_server_skips_its_teardown_at_exit():
    """Its forks inherit the armed module (and leave through os._exit anyway); the caller, and
    the environment it hands on, never carry the mark."""
    got = _start()
    assert got["quick_exit"] is True and got["mark"] is None
    assert forkserver_exit.ARMED is False and forkserver_exit.MARK not in os.environ


def test_the_tokenizer_alone_is_the_one_load_gives_and_needs_no_modeling_code():
    from jigsaw.engines.model import ModelConfig, load, load_tokenizer

    text = "What is 12 + 30? Answer: 42"
    assert load_tokenizer(ModelConfig()).encode(text) == load(ModelConfig())[1].encode(text)
    probe = ("import sys; from jigsaw.engines.model import ModelConfig, load_tokenizer; load_tokenizer(ModelConfig()); "
             "print(sorted(m for m in sys.modules if m.startswith('transformers.models.qwen3')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
