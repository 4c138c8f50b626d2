"""Who a pipeline belongs to: its job's token, or the process that made it.

    Register(owner token, or "")  ─► owner_of(token, peer pid): the token; without one, the
        registering process's identity (pid and start time: a reused pid is someone else)
    Register of an existing pipeline, Migrate  ─► check(owners, name, owner): refused as
        name-taken unless it is the owner (compared as bytes, in constant time)

`jigsaw run` hands its token to its command ($JIGSAW_OWNER) and keeps it in the runtime
directory's owners/NAME (paths.kept_owner), where a worker started without that environment
and `jigsaw daemon migrate` find it.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from pathlib import Path

from jigsaw import protocol as pr


def identity(pid: int) -> str:
    """A process as no later one can be: its pid and its start time (in clock ticks after
    boot, /proc/PID/stat field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        start = stat[stat.rindex(")") + 2:].split()[19]
    except (OSError, ValueError, IndexError):
        start = "?"
    return f"process {pid} started at tick {start}"


def owner_of(token: str, pid: int) -> str:
    """The owner a registration claims: its token, else its process."""
    return token or identity(pid)


def check(owners: Mapping[str, str], name: str, owner: str) -> None:
    """`owner` made pipeline `name`, or ProtocolError (name-taken) says how to proceed."""
    held = owners.get(name)
    if held is None or not secrets.compare_digest(held.encode(), owner.encode()):  # str: ASCII only
        raise pr.ProtocolError("name-taken", f"pipeline {name!r} belongs to another job on this node: "
                                             "choose another name (jigsaw run --name), or start this process "
                                             "under that job's `jigsaw run`")
