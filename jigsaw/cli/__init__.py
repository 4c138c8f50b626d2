"""`jigsaw` command line: one module per subcommand, each a frozen `Args` dataclass (flags
and help come from its fields and their docstrings, via tyro) and a `run(args) -> int`.
Heavy imports happen inside `run`, so `jigsaw --help` stays light (no torch, no scipy).

    main.py          the console script: subcommand ─► its module, imported on use
    run.py           jigsaw run -- CMD: a pipeline under the node daemon (started on demand)
    daemon.py        jigsaw daemon [serve|status|stop|migrate]
    cluster.py       jigsaw cluster: the Ray cluster's nodes and the pipelines placed on them
    sim.py           jigsaw sim: simulated nodes, every policy, replays
    advise.py        jigsaw advise: should these jobs share a node, and at what cost
    timeline.py      jigsaw timeline: what every device did in a trace
    profile.py       jigsaw profile: measure a device's slowdown grid
    prior.py         jigsaw prior: write an analytic prior grid
    inspect_grid.py  jigsaw inspect: validate a grid and show what it predicts
    doctor.py        jigsaw doctor: what this machine offers the GPU backend
    demo.py          jigsaw demo: real pipelines on this CPU, several ways
"""
