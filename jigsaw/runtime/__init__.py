"""The node daemon and the pipeline-side client, over a Unix socket (jigsaw/protocol.py).

    worker process: client.py (Client: admission, binding, fail-open; heartbeats)
                    rollout.py (Rollout: a rollout worker's regimes from its forward steps)
                    across.py (Across: a pipeline placed on several nodes, a Client per node)
        ─► wire.py (length-prefixed frames on a 0700-directory socket; peers of another uid refused)
    daemon.py  Daemon: the serve loop; requests ─► jigsaw/node/ ─► Decision ─► grants.py (Grants)
               session.py   budget changes on their way to a worker
               owners.py    who a pipeline belongs to (its job's token, or the process that made it)
               housekeeping.py  lock, socket, traces, idle exit, status replies
               plumbing.py  the lock file, the listener, Prometheus metrics
               spanning.py  gangs of pipelines that span nodes, held until the cluster
                            controller (jigsaw/cluster/) admits them on every node at once
    paths.py     runtime directory, endpoint and environment names, the kept owner tokens
    node_info.py what the node's devices are (`jigsaw run`, `jigsaw doctor`)
"""
