"""serving/app.py's Generator records a finished request in Ray's own metric objects (ray.util.metrics),
which refuse an increment of 0. A request that ends with no token, or a draft whose every token was
rejected, must still be counted without failing the request (CI once saw a 500 "value must be >0, got 0")."""
import os
import sys
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from spotfill.serving.app import Generator, _metric  # noqa: E402


class Recording:
    """Wraps a real Ray metric and keeps what it was given (Ray's own checks still run)."""

    def __init__(self, metric):
        self.metric, self.calls = metric, []

    def __getattr__(self, name):
        real = getattr(self.metric, name)

        def call(value, *a, **kw):
            real(value, *a, **kw)
            self.calls.append((name, value))
        return call


@pytest.fixture
def generator():
    me = SimpleNamespace(metrics={
        "tokens": Recording(_metric("Counter", "t_spotfill_tokens", "t")),
        "drafted": Recording(_metric("Counter", "t_spotfill_drafted", "t")),
        "accepted": Recording(_metric("Counter", "t_spotfill_accepted", "t")),
        "accepted_length": Recording(_metric("Histogram", "t_spotfill_len", "t", boundaries=[1, 2, 4])),
        "acceptance": Recording(_metric("Gauge", "t_spotfill_rate", "t"))})
    return me


def finished(me, **update):
    Generator.func_or_class._finished(me, SimpleNamespace(**update))


def test_a_draft_with_every_token_rejected_is_recorded_without_an_error(generator):
    finished(generator, completion_tokens=3, drafted=6, accepted=0, verify_steps=3)
    assert generator.metrics["tokens"].calls == [("inc", 3)]
    assert generator.metrics["drafted"].calls == [("inc", 6)]
    assert generator.metrics["accepted"].calls == []
    assert generator.metrics["acceptance"].calls == [("set", 0.0)]
    assert generator.metrics["accepted_length"].calls == [("observe", 1.0)]


def test_a_request_with_no_token_and_no_draft_records_nothing_and_does_not_fail(generator):
    finished(generator, completion_tokens=0, drafted=0, accepted=0, verify_steps=0)
    assert all(not m.calls for m in generator.metrics.values())


def test_ray_counters_do_refuse_zero_so_the_guard_is_needed():
    with pytest.raises(ValueError):
        _metric("Counter", "t_spotfill_zero", "t").inc(0)
