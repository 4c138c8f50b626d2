"""The cost model: how much a sub-stage kind slows down under a budget, alone or beside another.

    specs.py      devices, models (ModelSpec), PriorConfig; Deployment = (model, PriorConfig)
        ▼
    roofline.py   Roofline: per-token work of a kind at a memory share, timed under an SM
        ▼         share; alone, partitioned and shared pairs (each side its own roofline)
    prior.py      analytic priors: a model's own, a pair of deployments, the mix of a node
        ▼         (one builder), SHIPPED priors ─► SlowdownGrid
    pairing.py    PairView / PairGrids: each pair of a node's deployments as one grid
        ▼
    grids.py      which grids a node plans and runs with (node_grid for the daemon;
                  prior_grid, pair_grids, step_cost for the simulator)

    slowdown.py   SlowdownGrid: file format v1, validation, interpolation, load_grid (profiles/)
    validate.py   does a measured grid describe the device or the load on it?
    learned.py    GridLearner: a grid refined online from finished grants (a rule per entry)
    costmodel.py  StepCost: exclusive decode / prefill / reference / training times (roofline)

The config flows one way, down the arrows; nothing here imports torch or graph/.
"""
