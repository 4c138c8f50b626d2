"""One sample of a simulated rollout: its sequence so far and what it still has to generate.

    Request(rid, context, turns, appended, tool_s) ─► rollout.py (the engine) moves it
        queue ─► prefill ─► decode ─► tool wait ─► next turn ─► done; kvpool.py counts its KV
        (context − pending held, output_tokens for retraction order)

Its own module so that the engine and its KV pool both read it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Request:
    """One sample: its whole sequence so far and what it still has to generate."""

    rid: int
    context: int
    """Tokens of the sequence so far (prompt, generated, appended)."""
    turns: list[int]
    appended: list[int]
    tool_s: list[float]
    turn: int = 0
    generated: int = 0
    """Tokens generated in the current turn."""
    pending: int = 0
    """Tokens of the context not in the KV cache yet (to prefill)."""
    ready_at: float = 0.0
    """When its tool call returns."""
    done_tokens: int = field(init=False)
    """Tokens generated in the turns before this one: `sum(turns[:turn])`, kept as turns end
    (the KV pool reads it for every running request at every step)."""
    to_append: int = field(init=False)
    """Tool output still to come: `sum(appended[turn:])`, kept as turns end."""

    def __post_init__(self) -> None:
        self.done_tokens = sum(self.turns[:self.turn])
        self.to_append = sum(self.appended[self.turn:])

    def next_turn(self) -> int:
        """End this turn: the tool output appended to the context, to prefill; returns its tokens."""
        added = int(self.appended[self.turn])
        self.done_tokens += self.turns[self.turn]
        self.to_append -= added
        self.turn, self.generated = self.turn + 1, 0
        self.context += added
        self.pending = added
        return added

    def cut(self) -> None:
        """End it here, with what it generated (a wall-clock limit): no more turns or tools."""
        self.turns = [*self.turns[:self.turn], self.generated]
        self.appended, self.tool_s = self.appended[:self.turn], self.tool_s[:self.turn]
        self.to_append = 0

    @property
    def left(self) -> int:
        return self.turns[self.turn] - self.generated

    @property
    def response_tokens(self) -> int:
        return sum(self.turns)

    @property
    def output_tokens(self) -> int:
        """Tokens generated so far, every turn (what SGLang's retraction order looks at)."""
        return self.done_tokens + self.generated

    @property
    def final_context(self) -> int:
        """Its context once every turn is generated and every tool output appended."""
        return self.context + self.left + sum(self.turns[self.turn + 1:]) + sum(self.appended[self.turn:])
