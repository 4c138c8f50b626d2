"""A pipeline's driver run line by line from stdin (tests): it enters and leaves sub-stages and
says where a process it starts would run.

    stdin: enter KIND [computes]  ─► opens the sub-stage (blocks until admitted)
           probe                  ─► nothing changes
           exit                   ─► closes the sub-stage entered last
           quit
    stdout: one JSON line per command: {"granted": cores of its partition or null,
            "child": the cores a process started now runs on, "driver": this process's}

A started process inherits the cores of the thread that starts it, as a tool's sandbox does.
"""

import contextlib
import json
import os
import subprocess
import sys

from jigsaw.runtime.client import connect

CHILD = "import os; print(sorted(os.sched_getaffinity(0)))"


def where(handle) -> dict:
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    cores = getattr(handle.partition, "cores", None) if handle is not None else None
    return {"granted": list(cores) if cores is not None else None, "child": json.loads(child.stdout),
            "driver": sorted(os.sched_getaffinity(0))}


def main() -> None:
    client = connect(pipeline=sys.argv[1], endpoint=sys.argv[2])
    open_: list[tuple[contextlib.ExitStack, object]] = []
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "quit":
            break
        if cmd == "enter":
            stack = contextlib.ExitStack()
            handle = stack.enter_context(client.substage(args[0], computes="computes" in args))
            open_.append((stack, handle))
        elif cmd == "exit":
            open_.pop()[0].close()
        print(json.dumps(where(open_[-1][1] if open_ else None)), flush=True)
    for stack, _ in reversed(open_):
        stack.close()
    client.close()


if __name__ == "__main__":
    main()
