"""The environment a pipeline's processes find their node by: `jigsaw run` sets it for its command,
and the cluster's launch (cluster/launch.py) for a command it places; the client reads it
(runtime/client.py connect, runtime/across.py).  Names only: importing this costs nothing.
"""

ENV_DIR = "JIGSAW_RUNTIME_DIR"
"""The runtime directory (the daemon's socket, lock and traces)."""
ENV_ENDPOINT = "JIGSAW_ENDPOINT"
"""The node daemon's endpoint (ipc://PATH)."""
ENV_PIPELINE = "JIGSAW_PIPELINE"
"""The pipeline's name."""
ENV_OWNER = "JIGSAW_OWNER"
"""The owner token of the job that registered the pipeline."""
ENV_NODES = "JIGSAW_NODES"
"""A pipeline placed on several nodes of a cluster: JSON [[node id, its daemon's endpoint,
devices], ...]."""
