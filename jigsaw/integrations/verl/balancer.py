"""The daemon's routing weights bias which rollout replica verl sends a new request to.

    jigsaw run ─► router.install(): verl's router builds JigsawBalancer (router.py)
    JigsawBalancer (a Ray actor; verl's GlobalRequestLoadBalancer: sticky sessions, least in
                    flight, the public subclass hook of verl 0.9.1's router)
        __init__           every jigsaw replica server learns the balancer (set_router)
        set_routing(w)  ◄── a replica whose grant carries the plan's routing (serving.py):
                            w[r] = share of new requests for DP rank r
        acquire_server(id)  sticky first (a multi-turn request stays where its KV is), else
                            the server with the least in flight per unit of its weight; server
                            i is replica i, on DP rank i mod len(w) (placement.py)

Mux-aware balancing (DESIGN §2.7): a DP worker slowed by its partner gets fewer requests, so
every worker finishes together.  Without weights it is verl's balancer as it is.
"""

from __future__ import annotations

import logging
import random

import ray
from verl.workers.rollout.router import GlobalRequestLoadBalancer

from jigsaw.integrations.verl.placement import dp_rank

log = logging.getLogger("jigsaw.verl")
TELL_TIMEOUT_S = 30.0


class JigsawBalancer(GlobalRequestLoadBalancer):
    def __init__(self, servers: dict, max_cache_size: int | None = None, full_determinism: bool = False):
        kw = {} if max_cache_size is None else {"max_cache_size": max_cache_size}
        super().__init__(servers, full_determinism=full_determinism, **kw)
        self.weights: tuple[float, ...] = ()
        self.routed = 0
        """New (not sticky) requests placed by the weights."""
        me = ray.get_runtime_context().current_actor
        told = [h.set_router.remote(me) for h in self._servers.values() if hasattr(h, "set_router")]
        try:  # jigsaw's replicas push the plan's weights; without them this is verl's balancer
            ray.get(told, timeout=TELL_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - routing is a bias: verl routes on without it
            log.warning("jigsaw: rollout replicas did not take the router (%s); no routing weights", exc)

    def set_routing(self, weights) -> None:
        w = tuple(float(x) for x in weights)
        self.weights = w if w and all(x >= 0 for x in w) and sum(w) > 0 else ()

    def server_weights(self) -> dict[str, float]:
        """Each server's share of new requests: its DP rank's weight over the servers there."""
        ids = list(self._servers)
        ranks = [dp_rank(i, len(self.weights)) for i in range(len(ids))]
        return {sid: self.weights[r] / ranks.count(r) for sid, r in zip(ids, ranks)}

    def acquire_server(self, request_id: str):
        if not self.weights or request_id in self._request_id_to_server or not self._inflight_requests:
            return super().acquire_server(request_id)
        share = self.server_weights()
        live = [sid for sid in self._inflight_requests if share.get(sid, 0.0) > 0]
        if not live:
            return super().acquire_server(request_id)
        load = {sid: (self._inflight_requests[sid] + 1) / share[sid] for sid in live}
        least = min(load.values())
        server_id = random.choice([sid for sid, x in load.items() if x <= least * (1 + 1e-9)])
        self._request_id_to_server[request_id] = server_id
        self._inflight_requests[server_id] += 1
        self.routed += 1
        return server_id, self._servers[server_id]

    def routing_status(self) -> dict:
        return {"weights": list(self.weights), "routed": self.routed, "inflight": dict(self._inflight_requests)}
