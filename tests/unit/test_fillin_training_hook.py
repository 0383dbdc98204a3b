"""The training hook claims a group's GPUs before Ray Train resizes, and never stops training when the
arbiter is missing or broken (it logs instead)."""
import logging
from dataclasses import dataclass, field

from spotfill.config.job import JobConfig, from_mapping
from spotfill.train.fillin_claims import ClaimSpec, FillinClaimCallback, training_callbacks


@dataclass
class Decision:                     # the fields of Ray Train's ResizeDecision the hook reads
    num_workers: int
    resources_per_worker: dict = field(default_factory=dict)


SPEC = ClaimSpec("job", 1, 4, 1, "GPU_SLOT", deadline_s=5.0)


def test_claims_the_groups_gpus_before_the_resize():
    calls = []
    hook = FillinClaimCallback(SPEC, claim=lambda spec, gpus, gpw: calls.append((spec.job, gpus, gpw)) or
                               {"ok": True, "reason": "2 of 2 free"})
    hook.before_controller_execute_resize_decision(Decision(2, {"GPU_SLOT": 2.0, "CPU": 1}))
    assert calls == [("job", 4, 2)] and hook.answers == [{"ok": True, "reason": "2 of 2 free"}]


def test_a_group_pinned_to_its_warm_nodes_claims_there_once_per_restart():
    """The policy's sizing pins a restart to the survivors' warm nodes: the claim asks for the GPUs there
    and the group gets a label selector on them -- once: a pinned start that failed is retried unpinned."""
    from spotfill.train import elastic
    policy = elastic.DrainAwareElasticPolicy.__new__(elastic.DrainAwareElasticPolicy)
    policy._pin = ("node-b", "node-a")
    elastic.PINNED[id(policy)] = policy
    try:
        calls = []
        hook = FillinClaimCallback(SPEC, claim=lambda spec, gpus, gpw, nodes=None: calls.append(nodes) or
                                   {"ok": True, "reason": "3 of 3 free"})
        hook.before_controller_execute_resize_decision(Decision(3, {"GPU_SLOT": 1.0}))
        assert calls == [("node-b", "node-a")]
        selector = policy.on_controller_start_worker_group(scaling_config=None, num_workers=3)
        assert selector == {"ray.io/node-id": "in(node-a,node-b)"}
        # the pinned start timed out (a node went meanwhile): the retry is placed and claimed by Ray alone
        assert policy.on_controller_start_worker_group(scaling_config=None, num_workers=3) is None
        hook.before_controller_execute_resize_decision(Decision(3, {"GPU_SLOT": 1.0}))
        assert calls[-1] is None
    finally:
        elastic.PINNED.pop(id(policy), None)


def test_a_broken_or_missing_arbiter_never_stops_training(caplog):
    def broken(spec, gpus, gpw):
        raise TimeoutError("arbiter did not answer")

    def broken_release(spec):
        raise RuntimeError("gone")

    hook = FillinClaimCallback(SPEC, claim=broken, release=broken_release)
    with caplog.at_level(logging.INFO, logger="spotfill.train.fillin_claims"):
        hook.before_controller_execute_resize_decision(Decision(3, {"GPU_SLOT": 1}))
        hook.after_controller_finish(None)
        FillinClaimCallback(SPEC, claim=lambda *a: None).before_controller_execute_resize_decision(Decision(1))
    text = caplog.text
    assert "claim for job failed (TimeoutError: arbiter did not answer); training goes on" in text
    assert "releasing job failed" in text and "no arbiter on this cluster" in text


def test_training_callbacks_from_the_job_config():
    job = from_mapping(JobConfig, {"name": "demo", "storage": "/tmp/x", "data": {"path": "/tmp/d"},
                                   "cluster": {"gpu_resource": "GPU_SLOT"},
                                   "training": {"workers": [2, 4], "global_batch": 12}})
    (hook,) = training_callbacks(job)
    assert hook.spec == ClaimSpec("demo", 2, 4, 1, "GPU_SLOT")
    from spotfill.ray_compat import ControllerCallback
    assert isinstance(hook, ControllerCallback)
