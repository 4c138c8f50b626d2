"""Sub-stage multiplexing model: how much two co-located sub-stages slow each other.

    profiles/<sku>/<model>.prior.json ──load──► SlowdownGrid ──slowdown()/pair_options()──► scheduler
    prior.analytic_prior(device, model) ──────────┘  (roofline prior until a device is measured)

`slowdown` holds the grid file format, its validation and interpolation; `prior`
builds a labelled analytic stand-in for a measured grid; `prior_mix` the priors of two
different models sharing a device, and `pairing` the per-pair views a node of several
models is planned and simulated with.  Nothing here imports torch.
"""
