"""Entry point of the `jigsaw` console script.

    argv ─► tyro (one subcommand per module in COMMANDS) ─► Args ─► module.run(args) ─► exit code

A subcommand module is imported to read its `Args`; it must keep its top-level imports
light.  Expected user errors (a malformed profile, a missing file, an extra not installed:
jigsaw.extras.MissingExtra) print one line and exit 2 instead of a traceback.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Sequence

COMMANDS = {
    "sim": "jigsaw.cli.sim",
    "advise": "jigsaw.cli.advise",
    "prior": "jigsaw.cli.prior",
    "inspect": "jigsaw.cli.inspect_grid",
    "timeline": "jigsaw.cli.timeline",
    "daemon": "jigsaw.cli.daemon",
    "run": "jigsaw.cli.run",
    "cluster": "jigsaw.cli.cluster",
    "doctor": "jigsaw.cli.doctor",
    "profile": "jigsaw.cli.profile",
    "demo": "jigsaw.cli.demo",
}
"""Subcommand name -> module defining `Args` and `run`."""

DESCRIPTION = ("jigsaw multiplexes LLM RL post-training pipelines on shared GPUs: sub-stage graphs, "
               "a slowdown model, SM/memory partitions and a look-ahead scheduler.")


def main(argv: Sequence[str] | None = None) -> int:
    import tyro

    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if argv[:1] == ["run"] and "--" in argv:  # `jigsaw run [flags] -- CMD ...`: CMD is not ours to parse
        cut = argv.index("--")
        argv, cmd = argv[:cut], argv[cut + 1:]
    modules = {name: importlib.import_module(path) for name, path in COMMANDS.items()}
    try:
        args = tyro.extras.subcommand_cli_from_dict(
            {name: mod.Args for name, mod in modules.items()}, prog="jigsaw", description=DESCRIPTION, args=argv)
    except ValueError as exc:  # a config section's own check of its flags (__post_init__), said as a usage error
        print(f"jigsaw: error: {exc}", file=sys.stderr)
        return 2
    if cmd:
        args = dataclasses.replace(args, cmd=tuple(cmd))
    module = next(m for m in modules.values() if isinstance(args, m.Args))
    from jigsaw.extras import MissingExtra

    try:
        return int(module.run(args) or 0)
    except (FileNotFoundError, ValueError, KeyError, MissingExtra) as exc:
        # ValueError covers SlowdownFileError, whose text names the file, field and problem.
        print(f"jigsaw: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
