"""verl's rollout router under `jigsaw run`: the daemon's routing weights bias new requests.

    router._wrap(verl's router module) ─► get_router_handle builds JigsawBalancer (a Ray actor)
        unless the job routes its own way (a YAML router, a class of its own, full_determinism)
    JigsawBalancer: weights per DP rank (set by a replica's grant) ─► new requests spread by
        in-flight per unit of weight; sticky requests stay; no weights: verl's least in flight
"""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("verl", reason="verl is not installed: pip install -c constraints.txt -e '.[dev,verl]'")
ray = pytest.importorskip("ray")

pytestmark = [pytest.mark.verl, pytest.mark.timeout(120)]


class Replica:
    """A replica server as the balancer sees it: a Ray actor that may take the router's handle."""

    def __init__(self):
        self.router = None

    def set_router(self, router) -> None:
        self.router = router

    def has_router(self) -> bool:
        return self.router is not None


@pytest.fixture(scope="module")
def cluster():
    import sys

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers do not import tests/
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture
def servers(cluster):
    handles = {f"jigsaw_rollout_{r}": ray.remote(Replica).remote() for r in range(2)}
    yield handles
    for h in handles.values():
        ray.kill(h)


def balancer(servers, **kw):
    from verl.workers.rollout import router as verl_router

    from jigsaw.integrations.verl.router import _wrap

    _wrap(verl_router)
    _wrap(verl_router)  # once only
    assert verl_router.get_router_handle.jigsaw
    return verl_router.get_router_handle(servers, **kw)


def spread(lb, ids) -> Counter:
    return Counter(ray.get(lb.acquire_server.remote(request_id=i), timeout=30)[0] for i in ids)


def test_new_requests_follow_the_plans_weights_and_sticky_ones_stay(servers):
    lb = balancer(servers)
    ray.get(lb.routing_status.remote(), timeout=30)  # constructed
    assert ray.get([h.has_router.remote() for h in servers.values()], timeout=30) == [True, True]
    even = spread(lb, [f"a{i}" for i in range(8)])
    assert even == Counter({"jigsaw_rollout_0": 4, "jigsaw_rollout_1": 4})  # no weights: verl's least in flight
    ray.get([lb.release_server.remote(server_id=sid) for sid, n in even.items() for _ in range(n)], timeout=30)
    ray.get(lb.set_routing.remote([0.75, 0.25]), timeout=30)
    skewed = spread(lb, [f"b{i}" for i in range(8)])
    assert skewed == Counter({"jigsaw_rollout_0": 6, "jigsaw_rollout_1": 2})
    first = ray.get(lb.acquire_server.remote(request_id="a1"), timeout=30)[0]
    again = ray.get(lb.acquire_server.remote(request_id="a1"), timeout=30)[0]
    assert first == again  # a multi-turn request stays where its KV cache is
    assert ray.get(lb.routing_status.remote(), timeout=30)["routed"] == 8


def test_a_job_that_routes_its_own_way_keeps_verls_balancer(servers):
    lb = balancer(servers, full_determinism=True)
    assert not hasattr(lb, "set_routing")  # verl's own class: hash routing stays deterministic
