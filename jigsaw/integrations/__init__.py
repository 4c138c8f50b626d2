"""Adapters that put jigsaw into other frameworks without modifying them.

    verl/    unmodified verl 0.9.1 jobs: a CPU platform, the "jigsaw" rollout backend, stage gating
    sglang/  an SGLang plugin: per-forward counts, the pdmux SM share
"""
