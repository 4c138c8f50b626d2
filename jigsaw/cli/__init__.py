"""`jigsaw` command line: one module per subcommand, each a frozen `Args` dataclass (flags
and help come from its fields and their docstrings, via tyro) and a `run(args) -> int`.
Heavy imports happen inside `run`, so `jigsaw --help` stays light (no torch, no scipy)."""
