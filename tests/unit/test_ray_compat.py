"""Every private Ray hook resolves against the installed Ray, and a moved one fails loudly at import."""
import pytest

from spotfill import ray_compat


def test_every_hook_resolves_with_its_signature():
    assert len(ray_compat.HOOKS) >= 8
    for owner, name, params in ray_compat.HOOKS:
        ray_compat._require(owner, name, params)


def test_a_missing_hook_fails_loudly_naming_it():
    class Owner:
        def present(self, a, b):
            pass

    with pytest.raises(ray_compat.RayCompatError, match="absent"):
        ray_compat._require(Owner, "absent", ())
    with pytest.raises(ray_compat.RayCompatError, match=r"present\('b', 'a'\)"):
        ray_compat._require(Owner, "present", ("b", "a"))


def test_scaling_policy_swap_keeps_the_trainer_a_trainer():
    from ray.train.torch import TorchTrainer

    from spotfill.train.elastic import SpotfillTorchTrainer
    assert issubclass(SpotfillTorchTrainer, TorchTrainer)
    assert SpotfillTorchTrainer.__name__ == "SpotfillTorchTrainer"
