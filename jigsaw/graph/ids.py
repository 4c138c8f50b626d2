"""Sub-stage ids: the one place that writes and reads `<pipeline>/<step>/r<rank>/<kind>/<ordinal>`.

    SubStageId(pipeline, step, rank, kind, ordinal) ──str()──► "A/3/r0/rollout_tail/1"
                              ▲                                       │
                              └──────────── SubStageId.parse ◄────────┘

The ordinal counts the sub-stages of one kind on one DP worker within a step, in order, so
the same position in two steps has the same id apart from the step (which is how a
prediction is matched to what really runs).  `ordinal == "all"` marks a summary piece (a
worker's whole rollout of a predicted step).  Pipeline names carry no separator, so every id
parses back; `check_name` says why a name is refused.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jigsaw.graph.substage import SubStageKind

SEP = "/"
SUMMARY = "all"
"""Ordinal of a summary piece (one per worker and predicted step)."""
MAX_NAME_LEN = 128
_NAME = re.compile(r"[A-Za-z0-9._:@+=-]+")


def check_name(name: object) -> str:
    """A pipeline name usable in ids, traces and file names; ValueError says why not."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"pipeline name must be a non-empty string, got {name!r}")
    if len(name) > MAX_NAME_LEN:
        raise ValueError(f"pipeline name {name[:20]!r}... is {len(name)} characters; at most {MAX_NAME_LEN}")
    if not _NAME.fullmatch(name):
        raise ValueError(f"pipeline name {name!r} may only hold letters, digits and ._:@+=- "
                         f"('{SEP}' separates the parts of a sub-stage id)")
    return name


@dataclass(frozen=True, slots=True)
class SubStageId:
    """The parts of a sub-stage id; `str()` is the id used in graphs, grants and traces."""

    pipeline: str
    step: int
    rank: int
    kind: SubStageKind
    ordinal: int | str = 0
    """n-th sub-stage of this kind on this worker in this step, or SUMMARY."""

    def __str__(self) -> str:
        return f"{self.pipeline}/{self.step}/r{self.rank}/{self.kind.value}/{self.ordinal}"

    @property
    def position(self) -> str:
        """The id without pipeline and step: the same place in another step's graph."""
        return f"r{self.rank}/{self.kind.value}/{self.ordinal}"

    def at_step(self, step: int) -> SubStageId:
        return SubStageId(self.pipeline, step, self.rank, self.kind, self.ordinal)

    @classmethod
    def parse(cls, text: str) -> SubStageId:
        """The parts of an id; ValueError names the id and the expected form."""
        parts = text.split(SEP) if isinstance(text, str) else []
        try:
            if len(parts) != 5 or not parts[2].startswith("r"):
                raise ValueError
            ordinal: int | str = parts[4] if parts[4] == SUMMARY else int(parts[4])
            sid = cls(parts[0], int(parts[1]), int(parts[2][1:]), SubStageKind(parts[3]), ordinal)
            if sid.step < 0 or sid.rank < 0 or (isinstance(ordinal, int) and ordinal < 0) or not parts[0]:
                raise ValueError
        except ValueError:
            raise ValueError(f"sub-stage id {text!r} is not pipeline/step/rRANK/kind/n") from None
        return sid

    @classmethod
    def try_parse(cls, text: str) -> SubStageId | None:
        """The parts of an id, or None for one in another form (a hand-made graph's)."""
        try:
            return cls.parse(text)
        except ValueError:
            return None


def with_step(sid: str, step: int) -> str:
    """The same position in another step (ids of a predicted step from the last one's);
    for any id that starts pipeline/step/."""
    name, _, rest = sid.split(SEP, 2)
    return f"{name}/{step}/{rest}"


def pipeline_of(sid: str) -> str:
    """The pipeline an id names, for any id that starts pipeline/."""
    return sid.partition(SEP)[0]


def position_of(sid: str) -> str:
    """The id without pipeline and step, for any id that starts pipeline/step/."""
    return sid.split(SEP, 2)[2]
