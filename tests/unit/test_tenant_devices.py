"""The batch actor and the sweep trial take their device and precision from spotfill.devices -- the choice
from Ray's assignment -- and nothing else: with the choice replaced by one that records its calls and says
"cpu in bf16" (a precision this CPU can compute in, unlike the fp32 the real choice gives it), a batch unit
and a sweep step run in bf16 and say so. The choice itself is tested in test_devices.py; that Ray's
assignment reaches it, in tests/integration/test_tenant_devices.py."""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from benchmarks import gpu_tenants  # noqa: E402


@pytest.fixture
def choice(monkeypatch):
    from spotfill import devices
    calls = []

    def assigned_device(gpu_ids=None):
        calls.append(gpu_ids)
        return torch.device("cpu")

    monkeypatch.setattr(devices, "assigned_device", assigned_device)
    monkeypatch.setattr(devices, "compute_dtype", lambda device, requested="auto": torch.bfloat16)
    monkeypatch.setattr(devices, "ray_gpu_ids", lambda: ["7"])
    return calls


def test_a_batch_unit_computes_on_the_device_and_precision_spotfill_devices_chose(choice, tmp_path):
    from spotfill.fillin import batch, batch_plan as bp
    from spotfill.storage.base import open_storage
    from spotfill.train.model import build_model

    data = gpu_tenants.write_dataset(str(tmp_path / "data"), rows=8)
    out = open_storage(str(tmp_path / "out"))
    import io
    buf = io.BytesIO()
    torch.save(build_model("tiny", seq_len=gpu_tenants.SEQ_LEN).state_dict(), buf)
    out.put_bytes(bp.MODEL_KEY, buf.getvalue())
    plan = {"eval_rows": 8, "eval_data": data, "prompt_ids": ["0"], "max_tokens": 4, "temperature": 0.0, "seed": 0,
            "model": "tiny"}
    worker = batch.UnitWorker(str(tmp_path / "out"), plan, eval_batch=4, prompts=["def f("])
    assert choice == [None]                                  # Ray's assignment, not a device of its own
    assert {p.dtype for p in worker.model.parameters()} == {torch.bfloat16}
    units = [bp.Unit("eval", 0, 0, 8), bp.Unit("generate", 0, 0, 1)]
    worker({"unit": [json.dumps(u.as_dict()) for u in units]})
    for u in units:
        marker = json.loads(out.get_bytes(u.marker))
        assert (marker["device"], marker["dtype"], marker["gpu_ids"]) == ("cpu", "bfloat16", ["7"]), marker


def test_a_sweep_step_computes_on_the_device_and_precision_spotfill_devices_chose(choice, tmp_path):
    from spotfill.fillin.sweep_trial import trainable_class

    cls = trainable_class()
    trial = cls.__new__(cls)                                  # setup and step alone, without Tune's session
    trial.setup({"lr": 1e-3, "warmup_steps": 0}, job={
        "data": gpu_tenants.write_dataset(str(tmp_path / "data"), rows=16), "model": "tiny", "steps": 2, "batch": 2,
        "steps_per_report": 2, "eval_rows": 4, "seed": 0})
    assert choice == [None]
    result = trial.step()
    assert (result["device"], result["dtype"], result["gpu_ids"]) == ("cpu", "bfloat16", ["7"]), result
    assert result["done"] and result["eval_loss"] > 0 and result["history_ok"], result
