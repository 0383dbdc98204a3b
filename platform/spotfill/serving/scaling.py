"""Serve's autoscaling policy for deployments whose replica count the fill-in arbiter sets through the external
scaler (spotfill's Generator, the vLLM server of serving/vllm.py). A module of its own, importing nothing:
Serve imports a policy given by path and pickles it by value (Ray 2.60: serve/config.py AutoscalingPolicy)."""
from __future__ import annotations

POLICY_PATH = "spotfill.serving.scaling:keep_external_target"


def keep_external_target(ctx):
    """No decision of its own -- the replica count stays what the arbiter set through the external scaler
    (Serve still scales a deployment with 0 running replicas to 1 when requests wait for it, before this
    policy runs; the arbiter stops such a replica again: Arbiter._stop_extra_replicas)."""
    return ctx.target_num_replicas, {}
