"""The cluster layer: pipelines placed on the nodes of a cluster of GPU kinds.

    spec.py       `--nodes 4xh100,2xa100:4` ─► (NodeKind, ...): nodes of each GPU kind
    placement.py  which pipelines share which nodes, each group's kind and node count: a pure
                  search over groupings and node counts, priced by an estimate the caller owns;
                  RollMux's admission (admit), the baseline
    simulate.py   the simulator's estimate (each group's first steps, jigsaw or alone) and the
                  cluster run: every group simulated on its kind (`jigsaw sim --nodes`)
    gangs.py      gangs that span nodes admitted whole or not at all, in any arrival order (pure)
    controller.py the controller as a detached Ray actor: nodes join, leave (heartbeats), are
                  placed on; gangs gated; NodeLink, a node's calls with deadlines (lost: decide alone);
                  RayLink, a node daemon's line (offers posted, answers by long poll: spanning.py)
    questions.py  the controller's placement questions (Asking: a batch; Arrival: one pipeline
                  beside the running ones), each a snapshot of its book, decided off its loop
    launch.py     pipelines submitted, placed, and each command run as a Ray task on its nodes
                  (JIGSAW_NODES: runtime/across.py, a client per node)

One node's scheduling stays the node's (jigsaw/node, the daemon): the cluster decides only
where pipelines run, and when a gang that spans nodes starts.
"""
