"""serving/app.py's application graph: under the fill-in arbiter the Generator starts with 0 replicas (only the
arbiter's lends create replicas), its Serve autoscaling policy keeps what the external scaler set, and bad
arguments name the field. No Ray cluster: the graph is built, not run."""
import os
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from spotfill.serving.app import ServeArgs, build, keep_external_target  # noqa: E402
from spotfill.config.errors import ConfigError  # noqa: E402


def _deployments(args):
    from ray.serve._private.build_app import build_app
    return {d.name: d for d in build_app(build(args), name="t").deployments}


def test_under_the_arbiter_the_generator_starts_with_no_replica():
    gen = _deployments(ServeArgs.parse({"checkpoint": "file:///x", "replicas": 0, "max_replicas": 3}))["Generator"]
    auto = gen._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.initial_replicas, auto.max_replicas) == (0, 0, 3)
    assert auto.policy.policy_function.endswith("keep_external_target")


def test_serve_run_alone_gets_fixed_replicas():
    gen = _deployments(ServeArgs.parse({"checkpoint": "file:///x"}))["Generator"]
    assert gen._deployment_config.autoscaling_config is None and gen.num_replicas == 1


def test_the_policy_keeps_the_external_target():
    for target in (0, 1, 4):
        assert keep_external_target(SimpleNamespace(target_num_replicas=target, current_num_replicas=0)) == (target, {})


@pytest.mark.parametrize("args, field", [({"replicas": -1}, "replicas"), ({"max_replicas": 0}, "max_replicas")])
def test_bad_args_name_the_field(args, field):
    with pytest.raises(ConfigError, match=f"^serving.app args {field}"):
        ServeArgs.parse({"checkpoint": "file:///x", **args})


def test_a_floor_is_a_deployment_of_its_own_on_the_head_with_no_gpu():
    deps = _deployments(ServeArgs.parse({"checkpoint": "file:///x", "replicas": 0, "floor_replicas": 2,
                                         "floor_cpus": 0.5}))
    floor = deps["GeneratorFloor"]
    opts = floor.ray_actor_options
    assert floor.num_replicas == 2 and opts["num_cpus"] == 0.5 and "num_gpus" not in opts
    assert opts["resources"] == {"node:__internal_head__": 0.001}
    assert "GeneratorFloor" not in _deployments(ServeArgs.parse({"checkpoint": "file:///x"}))
    gpu_floor = _deployments(ServeArgs.parse({"checkpoint": "file:///x", "floor_replicas": 1, "floor_device": "gpu",
                                              "floor_node": "any"}))["GeneratorFloor"]
    assert gpu_floor.ray_actor_options["num_gpus"] == 1 and "resources" not in gpu_floor.ray_actor_options


@pytest.mark.parametrize("args, field", [({"floor_replicas": -1}, "floor_replicas"), ({"floor_device": "tpu"}, "floor_device"),
                                         ({"floor_node": "x"}, "floor_node"), ({"floor_cpus": -1}, "floor_cpus")])
def test_bad_floor_args_name_the_field(args, field):
    with pytest.raises(ConfigError, match=f"^serving.app args {field}"):
        ServeArgs.parse({"checkpoint": "file:///x", **args})
