"""Under `jigsaw run`, verl's rollout router is jigsaw's (balancer.py), through verl's own hook.

    install() ─► once verl.workers.rollout.router is imported: its get_router_handle(...) gets
        load_balancer_cls=JigsawBalancer (the parameter verl 0.9.1 keeps for subclasses of its
        balancer), unless the job routes its own way: a router YAML (router_config_path), a
        class of its own, or full_determinism (hash routing, which a subclass would drop)

Kept apart from balancer.py, which imports verl and Ray: this runs inside verl's own import
of its plugins, before verl's router module exists.
"""

from __future__ import annotations

import logging
import os

from jigsaw.runtime.paths import ENV_PIPELINE

log = logging.getLogger("jigsaw.verl")
ROUTER_MODULE = "verl.workers.rollout.router"


def install() -> None:
    if not os.environ.get(ENV_PIPELINE):
        return  # not under `jigsaw run`: verl's router as it is
    from jigsaw.integrations.verl.imports import after_import

    after_import(ROUTER_MODULE, _wrap)


def _wrap(module) -> None:
    real = module.get_router_handle
    if getattr(real, "jigsaw", False):
        return

    def get_router_handle(servers, router_config_path=None, full_determinism=False, load_balancer_cls=None):
        if router_config_path or load_balancer_cls is not None or full_determinism:
            log.warning("jigsaw: this job routes rollout requests its own way; the daemon's routing weights "
                        "are not applied")
        else:
            from jigsaw.integrations.verl.balancer import JigsawBalancer

            load_balancer_cls = JigsawBalancer
        return real(servers, router_config_path=router_config_path, full_determinism=full_determinism,
                    load_balancer_cls=load_balancer_cls)

    get_router_handle.jigsaw = True
    module.get_router_handle = get_router_handle
