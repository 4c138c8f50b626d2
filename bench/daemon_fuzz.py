"""Fuzz a live daemon: N messages of every class in tests/fuzzing.py, each judged.

    python bench/daemon_fuzz.py [--messages 10000] [--seed 0]

    jigsaw daemon (own runtime dir) ◄── Prober: one message, its reply judged, a Status probe
        │                                  every --health-every messages
        ▼
    crashes (daemon exited) · hangs (no reply in 5 s) · wrong replies (req mismatch, an
    internal error, a grant that cannot be released) · RSS of the daemon start → end

Goal: 0 / 0 / 0 / flat.  Exit status 1 when any is not met.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from fuzzing import CLASSES, Prober, payloads  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from nodes import Node  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402


def rss_mib(pid: int) -> float:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def fuzz(node: Node, messages: int, seed_: int, health_every: int, console: Console) -> dict:
    prober = Prober(node.ep)
    seen, problems = Counter(), Counter()
    examples: dict[str, str] = {}
    rss = [rss_mib(node.daemon.pid)]
    t0 = time.monotonic()

    @seed(seed_)
    @settings(max_examples=messages, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one(data):
        n = sum(seen.values())
        if node.daemon.poll() is not None:
            problems["crash"] += 1
            return
        cls, payload = data.draw(payloads(prober.session))
        seen[cls] += 1
        problem = prober.exchange(cls, payload)
        if problem:
            kind = problem.split(":")[0]
            problems[kind] += 1
            examples.setdefault(kind, f"{cls}: {problem} ({payload[:60]!r})")
        if n % health_every == 0:
            if node.daemon.poll() is not None:
                problems["crash"] += 1
            elif sick := prober.healthy():
                problems[sick.split(":")[0].split(" ")[0]] += 1
                examples.setdefault(sick.split(" ")[0], sick)
            rss.append(rss_mib(node.daemon.pid))
            if n % (health_every * 20) == 0:
                console.print(f"  {n:>6} messages  {time.monotonic() - t0:6.1f} s  RSS {rss[-1]:.1f} MiB")

    one()
    if node.daemon.poll() is None:
        rss.append(rss_mib(node.daemon.pid))
    prober.close()
    return {"replies": prober.replies, "seen": seen, "problems": problems, "examples": examples, "rss": rss,
            "elapsed_s": time.monotonic() - t0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--health-every", type=int, default=50, help="a Status probe and an RSS sample every N messages")
    args = ap.parse_args()
    console = Console(width=140)
    with tempfile.TemporaryDirectory() as tmp:
        node = Node(Path(tmp))
        node.trace = Path(tmp) / "trace.jsonl"
        node.start()
        try:
            out = fuzz(node, args.messages, args.seed, args.health_every, console)
            crashed = node.daemon.poll() is not None
        finally:
            node.stop()
    rss, problems = out["rss"], out["problems"]
    crashes = problems["crash"] + int(crashed)
    hangs, wrong = problems["hang"], sum(v for k, v in problems.items() if k not in ("crash", "hang"))
    table = Table(title=f"daemon fuzz: {sum(out['seen'].values()):,} messages in {out['elapsed_s']:.0f} s")
    for col in ("crashes", "hangs", "wrong replies", "RSS start → end (MiB)", "RSS max"):
        table.add_column(col, justify="right")
    table.add_row(str(crashes), str(hangs), str(wrong), f"{rss[0]:.1f} → {rss[-1]:.1f}", f"{max(rss):.1f}")
    console.print(table)
    console.print("messages per class: " + ", ".join(f"{c} {out['seen'][c]:,}" for c in CLASSES))
    console.print("replies: " + ", ".join(f"{k} {v:,}" for k, v in out["replies"].most_common()))
    for kind, ex in out["examples"].items():
        console.print(f"[red]{kind}[/red]: {ex}")
    flat = rss[-1] - rss[0] < 32
    console.print(f"goal 0 / 0 / 0 / flat: {'met' if not (crashes or hangs or wrong) and flat else 'NOT met'}")
    return 0 if not (crashes or hangs or wrong) and flat else 1


if __name__ == "__main__":
    sys.exit(main())
