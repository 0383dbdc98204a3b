"""serving/app.py's Ingress when a replica is lost under a request (its node died outright): the request
was never answered, so it goes once more to another replica, else it gets 503 with Retry-After -- never a
500. Stand-ins for Serve's handle (no cluster): each call's outcome is set by the test."""
import asyncio
import json
import os
import sys

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from serving.app import Ingress, ServeArgs  # noqa: E402

ANSWER = {"text": "x = 1", "tokens": 3, "finish_reason": "length", "prompt_tokens": 4,
          "checkpoint": {"tag": "step-00000040-a0"}}


class _Ref:
    def __init__(self, outcome):
        self.outcome = outcome

    def __await__(self):
        async def resolve():
            if isinstance(self.outcome, BaseException):
                raise self.outcome
            return self.outcome
        return resolve().__await__()


class _Response:
    def __init__(self, outcome):
        self.outcome, self.cancelled = outcome, False

    async def _to_object_ref(self):
        return _Ref(self.outcome)

    def cancel(self):
        self.cancelled = True


class _Generator:
    """`generator.generate.remote(...)` as Serve's handle offers it; each call takes the next outcome."""

    def __init__(self, ingress, outcomes, live_after=None):
        self.ingress, self.outcomes, self.calls, self.live_after = ingress, list(outcomes), 0, live_after

    @property
    def generate(self):
        return self

    def remote(self, *args):
        self.calls += 1
        if self.live_after is not None:
            self.ingress.live = self.live_after          # the watch saw the lost replica go
        return _Response(self.outcomes.pop(0))


def _ingress(outcomes, live=2, live_after=None):
    ing = object.__new__(Ingress.func_or_class)
    ing.args, ing.live = ServeArgs.parse({"checkpoint": "file:///x"}), live
    ing.admit_timeout_s = 5.0
    ing.generator = _Generator(ing, outcomes, live_after)
    return ing


def _forward(ing):
    return asyncio.run(ing._forward("def f():", 8, 0.0, 0))


def test_a_request_whose_replica_died_goes_to_another_replica():
    ing = _ingress([ActorDiedError(), ANSWER])
    out, err = _forward(ing)
    assert err is None and out == ANSWER and ing.generator.calls == 2


@pytest.mark.parametrize("outcomes,live_after,calls", [
    ([ActorDiedError(), ActorUnavailableError("unreachable", b"\0" * 16)], None, 2),   # lost twice
    ([ActorDiedError()], 0, 1),                                                        # no replica left
])
def test_a_request_that_lost_its_replica_gets_503_with_retry_after_never_a_500(outcomes, live_after, calls):
    ing = _ingress(outcomes, live_after=live_after)
    out, err = _forward(ing)
    assert out is None and err.status_code == 503 and err.headers["Retry-After"] == "1"
    assert "lost with its node" in json.loads(err.body)["error"]["message"]
    assert ing.generator.calls == calls


def test_an_answered_request_is_sent_once():
    ing = _ingress([ANSWER])
    assert _forward(ing) == (ANSWER, None) and ing.generator.calls == 1
