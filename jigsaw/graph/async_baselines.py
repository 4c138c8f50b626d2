"""The asynchronous RL systems JigsawRL §5.3 compares against, as node policies.

    streamrl  StreamRL (one-step off-policy): each job on its own equal group of devices,
              its rollout and training workers disaggregated inside it (equal halves by
              default, the workload's rollout_frac), batch n generated while step n - 1
              trains; a synchronous job in the mix runs as verl on its group
    areal     AReaL (fully asynchronous): the same placement, rollouts never wait for a
              step, interrupted at each weight update and resumed with their partial output,
              staleness-bounded

What makes a pipeline one-step-off or fully async is its workload's `mode` (the simulator runs
its two sides, sim/asynchronous.py); these policies are `split` for such pipelines, each
refusing the other's mode so a table row says which system it is.  The placement and the
equal split are the papers' (JigsawRL §5.3: "disaggregated rollout and training workers with
equal resource allocation"); the jobs run side by side, each on its share, which on a shared
node is the strongest of the simple schemes (back to back, `serial`, is slower).
"""

from __future__ import annotations

from dataclasses import dataclass

from jigsaw.graph.baselines import Split
from jigsaw.graph.policy import Needs


@dataclass
class StreamRL(Split):
    """One-step off-policy jobs on their own groups, disaggregated (module docstring)."""

    name: str = "streamrl"
    mode: str = "one-step-off"

    def refusal(self, needs: Needs) -> str | None:
        other = sorted({p.mode for p in needs.pipelines} - {"sync", self.mode})
        if other:
            return (f"{self.name} runs {self.mode} pipelines (and sync ones as verl), not {', '.join(other)}; "
                    f"give the workloads mode = {self.mode!r} (jigsaw sim --mode)")
        return None


@dataclass
class AReaL(StreamRL):
    """Fully asynchronous jobs on their own groups, disaggregated (module docstring)."""

    name: str = "areal"
    mode: str = "fully-async"
