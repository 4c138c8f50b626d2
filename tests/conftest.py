"""Suite-wide rules: `gpu`-marked tests run only where CUDA is usable; no test reads or writes the
user's own profiles or runtime directory (grids measured on this machine must not change results);
no property test has a time limit per example, nor fails because drawing its data was slow (a
loaded machine must not fail a test: tests/waiting.py).

    tests/unit/         pure and fast: the scheduler, the node state, the simulator, the grids,
                        the daemon's logic on scripted clocks (no process, socket or engine)
    tests/integration/  processes, sockets, daemons, engines, the CLI, the README's commands
    tests/*.py          their helpers (importable from both: this directory is on sys.path)
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
settings.register_profile("jigsaw", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("jigsaw")


@functools.cache
def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.version.cuda is not None and torch.cuda.is_available()


def pytest_collection_modifyitems(config, items) -> None:
    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu and not cuda_available():
        skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
        for item in gpu:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _private_user_dirs(tmp_path_factory, monkeypatch) -> None:
    monkeypatch.setenv("JIGSAW_PROFILE_DIR", str(tmp_path_factory.mktemp("profiles")))
