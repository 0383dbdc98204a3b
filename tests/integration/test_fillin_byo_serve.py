"""Bring your own serving engine: a plain Serve deployment that is not spotfill's app, deployed with
external_scaler_enabled, becomes a fill-in tenant by name (fillin/serve_tenant.lend_to_serve_app): the
arbiter lends it the idle GPU slots (its replicas appear), a training claim takes them back (they go), and
they come back when training leaves. An app deployed without the external scaler is refused by name."""
from __future__ import annotations

import pytest

from spotfill.sim.cluster import free_port
from spotfill.testing.waiting import wait_for

pytestmark = pytest.mark.timeout(420)


def echo_app(name: str, slot: bool = True):
    """A trivial deployment, one GPU per replica (defined here: pickled by value)."""
    from ray import serve

    @serve.deployment(name=name, num_replicas=1, ray_actor_options={"num_cpus": 0, "num_gpus": 1 if slot else 0},
                      graceful_shutdown_timeout_s=2.0, graceful_shutdown_wait_loop_s=0.1)
    class Echo:
        def __call__(self, request) -> str:
            return "echo"
    return Echo.bind()


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from ray import serve

    from spotfill.serving.deploy import start_serve
    from spotfill.sim.fillin_cluster import fillin_cluster

    with fillin_cluster(2, 1, str(tmp_path_factory.mktemp("arbiter") / "state.json")) as (cluster, arbiter):
        start_serve(free_port(), "GPU")
        serve.run(echo_app("Echo"), name="byo", route_prefix="/byo", external_scaler_enabled=True)
        yield {"cluster": cluster, "arbiter": arbiter, "dashboard": cluster.cluster.webui_url}


def echo_replicas() -> int:
    from spotfill.ray_compat import gcs_actors
    return sum(1 for a in gcs_actors(("ALIVE",)) if a["class_name"] == "ServeReplica:byo:Echo")


def test_a_plain_serve_app_is_lent_gpus_and_gives_them_back(env):
    import ray

    from spotfill.fillin.serve_tenant import lend_to_serve_app
    answer = lend_to_serve_app("byo", "Echo", max_replicas=2)          # the dashboard the head registered
    assert answer["tenant"] == "serve:byo/Echo"
    wait_for(lambda: echo_replicas() == 2, 120, "the arbiter to lend the second slot to the plain app")
    st = ray.get(env["arbiter"].status.remote(), timeout=30)
    tenant = next(t for t in st["tenants"] if t["tenant"] == "serve:byo/Echo")
    assert (tenant["grace_s"], tenant["gpus_per_replica"]) == (2.0, 1)        # read from the deployment
    assert {le["tenant"] for le in st["leases"]} == {"serve:byo/Echo"} and len(st["leases"]) == 2
    claim = ray.get(env["arbiter"].claim.remote("train", 2, 20.0, 1, 1, 2), timeout=60)
    assert claim["ok"] and len(claim["reclaimed"]) == 2, claim
    wait_for(lambda: echo_replicas() == 0, 30, "the plain app's replicas to go")
    ray.get(env["arbiter"].release_job.remote("train"))
    wait_for(lambda: echo_replicas() == 2, 120, "the slots lent again after training left")


def test_an_app_without_the_external_scaler_is_refused_by_name(env):
    from ray import serve

    from spotfill.config.errors import ConfigError
    from spotfill.fillin.serve_tenant import lend_to_serve_app
    serve.run(echo_app("Fixed", slot=False), name="fixed", route_prefix="/fixed")      # no external scaler
    with pytest.raises(ConfigError, match="fixed: deployed without external_scaler_enabled"):
        lend_to_serve_app("fixed", "Fixed", max_replicas=1, dashboard_url=env["dashboard"])
    with pytest.raises(ConfigError, match="not a deployment of byo; accepted: Echo"):
        lend_to_serve_app("byo", "Nope", max_replicas=1, dashboard_url=env["dashboard"])
    serve.delete("fixed")
