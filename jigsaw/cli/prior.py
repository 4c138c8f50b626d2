"""`jigsaw prior`: write an analytic roofline prior slowdown grid.

    --device, --model, --prior.* ─► mux.model.prior.analytic_prior ─► SlowdownGrid.save ─► path
    --shipped ─► every prior listed in mux.model.prior.SHIPPED, into the shipped grids, profiles/ (or --profiles-dir)

A prior is a labelled stand-in until `jigsaw profile` measures the device; the file's
`source` says so and records every constant used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from jigsaw.mux.model.specs import MODELS, PriorConfig

ModelName = Literal[tuple(MODELS)]  # type: ignore[valid-type]


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """Write an analytic roofline prior slowdown grid (not a measurement)."""

    device: Literal["h100", "a100"] = "h100"
    """Device to model (datasheet peak FLOP/s, HBM bandwidth, SM count, memory)."""
    model: ModelName = "qwen3-4b"
    """Model whose sub-stages are modelled (architecture from its public config.json)."""
    out: Path | None = None
    """Output file; default <your profile dir>/<device>/<model>.prior.json (never a shipped file),
    where the name "<device>/<model>" finds it."""
    profiles_dir: Path | None = None
    """With --shipped: where to write; if unset, the shipped grids (a clone's profiles/)."""
    shipped: bool = False
    """Regenerate every prior shipped with jigsaw (a developer's command; ignores --out)."""
    prior: PriorConfig = PriorConfig()
    """Deployment (TP / FSDP degree), representative shapes and calibration constants."""


def run(args: Args) -> int:
    from jigsaw.mux.model.prior import SHIPPED, analytic_prior, shipped_path
    from jigsaw.mux.model.specs import DEVICES
    from jigsaw.profiles import SHIPPED_DIR, user_dir

    jobs = SHIPPED if args.shipped else ((args.device, args.model, args.prior),)
    root = (args.profiles_dir or SHIPPED_DIR) if args.shipped else user_dir()
    for device, model, config in jobs:
        path = args.out if (args.out and not args.shipped) else Path(shipped_path(root, device, model))
        path.parent.mkdir(parents=True, exist_ok=True)
        analytic_prior(DEVICES[device], model, config).save(path)
        print(path)
    return 0
