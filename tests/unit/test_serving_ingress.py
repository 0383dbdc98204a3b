"""serving/app.py's Ingress without a cluster: the OpenAI routes (whole and streamed answers, errors in
OpenAI's shape), waiting for a starting replica instead of an immediate 503, 503 at once when the replicas
were reclaimed, a request continued on another replica when its replica is lost or stopped, and the
accounting of lost (admitted) vs refused requests. Stand-ins for Serve's handles run the real engine."""
import asyncio
import collections
import json
import os
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from spotfill.serving.app import Ingress, ServeArgs  # noqa: E402
from spotfill.train.model import GPT, preset  # noqa: E402
from ray.exceptions import ActorDiedError  # noqa: E402

from tests.unit.test_generation_relay import Replica as EngineReplica  # noqa: E402


def Replica(model, name, die_after=None, admit=True):
    """A replica stand-in whose death is Ray's (ActorDiedError), as the Ingress sees it."""
    return EngineReplica(model, name, die_after, admit, error=ActorDiedError)


class Counter:
    def __init__(self):
        self.seen = collections.Counter()

    def inc(self, value=1, tags=None):
        self.seen[tuple(sorted((tags or {}).items()))] += value


class Handle:
    """generator.options(stream=True).stream.remote(job) and generator.info.remote() as Serve offers them."""

    def __init__(self, replicas, ingress):
        self.replicas, self.ingress = list(replicas), ingress
        self.stream, self.info = self, _Info()

    def options(self, stream=False):
        return self

    def remote(self, job):
        replica = self.replicas.pop(0)
        return replica.open(job)


class _Info:
    def remote(self):
        async def info():
            return {"tag": "step-1", "context": 64, "loaded_at": 1.0}
        return info()


class Req:
    def __init__(self, body):
        self.body = body

    async def json(self):
        if isinstance(self.body, bytes):
            raise json.JSONDecodeError("x", "x", 0)
        return self.body


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(preset("tiny")).eval()


def ingress(replicas, running=("a",), states=None, wait_s=2.0, ever_ran=True, floor=None):
    ing = object.__new__(Ingress.func_or_class)
    ing.args = ServeArgs.parse({"checkpoint": "file:///x", "max_queue_wait_s": wait_s,
                                "floor_replicas": len(floor or [])})
    ing.app_name, ing.running, ing.ever_ran, ing.relays, ing.loop = "app", list(running), ever_ran, set(), None
    ing.n_running = len(running)
    ing._states = (0.0, {})
    ing.admit_timeout_s = wait_s + 1
    ing.requests, ing.continued = Counter(), Counter()
    ing.generator = Handle(replicas, ing)
    ing.floor = Handle(floor, ing) if floor else None

    async def states_now():
        return dict(states or {})
    ing._replica_states = states_now
    return ing


def outcomes(ing):
    return {dict(k)["outcome"] + ":" + dict(k)["reason"]: v for k, v in ing.requests.seen.items()}


def streamed(ing, route, body):
    """The SSE data lines of a streamed answer (the request and its stream on one event loop, as in Serve)."""
    async def run():
        return await sse_events(await route(ing)(Req(body)))
    return asyncio.run(run())


async def sse_events(response):
    out = []
    async for piece in response.body_iterator:
        for line in piece.splitlines():
            if line.startswith("data: "):
                out.append(line[6:])
    return out


def test_a_completion_with_usage(model):
    ing = ingress([Replica(model, "a")])
    out = asyncio.run(ing.completions(Req({"prompt": "def f():", "max_tokens": 8, "temperature": 0})))
    assert out["object"] == "text_completion" and out["choices"][0]["finish_reason"] in ("length", "stop")
    assert out["usage"]["prompt_tokens"] == 8 and out["usage"]["total_tokens"] == 8 + out["usage"]["completion_tokens"]
    assert "spec_decode" not in out["usage"] and outcomes(ing) == {"ok:": 1}


def test_a_streamed_chat_completion_is_the_same_text_in_openais_chunks(model):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "temperature": 0}
    whole = asyncio.run(ingress([Replica(model, "a")]).chat_completions(Req(body)))
    events = streamed(ingress([Replica(model, "a")]), lambda i: i.chat_completions,
                      {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize("body, param", [({"prompt": "x", "n": 2}, "n"), ({"prompt": "x", "temperature": 3}, "temperature"),
                                         ({"prompt": 5}, "prompt"), ({"prompt": "x", "stop": [1]}, "stop"),
                                         (b"{not json", None)])
def test_bad_requests_get_400_in_openais_shape(model, body, param):
    resp = asyncio.run(ingress([]).completions(Req(body)))
    err = json.loads(resp.body)["error"]
    assert resp.status_code == 400 and err["type"] == "invalid_request_error" and err["param"] == param


def test_reclaimed_replicas_answer_503_at_once_and_it_is_a_refusal(model):
    ing = ingress([], running=(), states={})
    t0 = time.monotonic()
    resp = asyncio.run(ing.completions(Req({"prompt": "x"})))
    assert time.monotonic() - t0 < 0.5 and resp.status_code == 503 and resp.headers["Retry-After"] == "1"
    assert json.loads(resp.body)["error"]["code"] == "replicas_reclaimed"
    assert outcomes(ing) == {"rejected:replicas_reclaimed": 1}


def test_a_request_waits_for_a_starting_replica_instead_of_503(model):
    ing = ingress([Replica(model, "a")], running=(), states={"STARTING": 1}, wait_s=5.0)

    async def run():
        async def replica_up():
            await asyncio.sleep(0.5)
            ing._set_running(1, ["a"])
        asyncio.ensure_future(replica_up())
        t0 = time.monotonic()
        out = await ing.completions(Req({"prompt": "x", "max_tokens": 3}))
        return out, time.monotonic() - t0
    out, waited = asyncio.run(run())
    assert out["object"] == "text_completion" and waited >= 0.45


def test_starting_too_long_is_a_503_naming_it(model):
    ing = ingress([], running=(), states={"STARTING": 1}, wait_s=0.3)
    resp = asyncio.run(ing.completions(Req({"prompt": "x"})))
    assert resp.status_code == 503 and json.loads(resp.body)["error"]["code"] == "replica_starting"
    ing = ingress([], running=(), states={}, wait_s=0.3, ever_ran=False)
    resp = asyncio.run(ing.completions(Req({"prompt": "x"})))
    assert json.loads(resp.body)["error"]["code"] == "no_replica_lent"


def test_a_lost_replicas_stream_continues_uninterrupted(model):
    body = {"prompt": "def g(y):", "max_tokens": 25, "temperature": 0, "ignore_eos": True}
    whole = asyncio.run(ingress([Replica(model, "a")]).completions(Req(body)))
    ing = ingress([Replica(model, "a", die_after=3), Replica(model, "b")], running=("a", "b"))
    events = streamed(ing, lambda i: i.completions, {**body, "stream": True})
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == whole["choices"][0]["text"] and events[-1] == "[DONE]"
    assert outcomes(ing) == {"ok:": 1}


def test_a_request_lost_with_no_replica_left_is_counted_lost_not_refused(model):
    ing = ingress([Replica(model, "a", die_after=2)], running=("a",), wait_s=0.3)

    async def run():
        ing.loop = asyncio.get_running_loop()

        replica = ing.generator.replicas[0]
        orig = replica.open

        def open_then_lose(job):
            stream = orig(job)
            ing._set_running(0, [])              # the watch saw it go
            return stream
        replica.open = open_then_lose
        return await ing.completions(Req({"prompt": "x", "max_tokens": 30, "ignore_eos": True, "temperature": 0}))
    resp = asyncio.run(run())
    err = json.loads(resp.body)["error"]
    assert resp.status_code == 503 and err["code"] == "replica_lost" and "lost after" in err["message"]
    assert outcomes(ing) == {"lost:replica_lost": 1}


def test_requests_on_a_replica_told_to_stop_move_to_another(model):
    body = {"prompt": "abc", "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stream": True}
    whole = asyncio.run(ingress([Replica(model, "z")]).completions(Req({**body, "stream": False})))
    ing = ingress([Replica(model, "a"), Replica(model, "b")], running=("a", "b"))

    async def run():
        resp = await ing.completions(Req(body))
        events = []
        async for piece in resp.body_iterator:
            events.append(piece)
            if len(events) == 2:
                ing._set_running(1, ["b"])        # replica a was told to stop (its GPU reclaimed)
        return events
    events = asyncio.run(run())
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text == whole["choices"][0]["text"]
    assert ing.continued.seen[(("why", "replica_stopped"),)] == 1


def test_without_replica_ids_the_count_still_serves_and_nothing_moves(model):
    """The replica watch's fallback (serve.status(): counts, no ids): a request stays on its replica when the
    count changes -- moving it needs the ids of the replicas still running -- and the count alone says
    whether a replica runs."""
    body = {"prompt": "abc", "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stream": True}
    whole = asyncio.run(ingress([Replica(model, "z")]).completions(Req({**body, "stream": False})))
    ing = ingress([Replica(model, "a"), Replica(model, "b")], running=("a", "b"))

    async def run():
        ing.loop = asyncio.get_running_loop()
        resp = await ing.completions(Req(body))
        events = []
        async for piece in resp.body_iterator:
            events.append(piece)
            if len(events) == 2:
                ing._set_running(1, None)         # one replica fewer, which one unknown
                await asyncio.sleep(0.05)         # the migration callback had its turn
        return events, await ing.state()
    events, state = asyncio.run(run())
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text == whole["choices"][0]["text"] and state == "ready" and ing.live == 1
    replicas = {json.loads(e[6:]).get("replica") for e in events[:-1]} - {None}
    assert replicas == {"a"} and not ing.continued.seen, (replicas, ing.continued.seen)


def FloorReplica(model, name):
    r = Replica(model, name)
    r.floor = True
    return r


def test_with_a_floor_a_request_while_no_lent_replica_runs_is_answered_by_the_floor(model):
    """Training took every lent GPU back (no lent replica runs): the floor answers at once instead of a 503."""
    ing = ingress([], running=(), states={}, floor=[FloorReplica(model, "f")])
    out = asyncio.run(ing.completions(Req({"prompt": "x", "max_tokens": 3})))
    assert out["object"] == "text_completion" and out["served_by"] == "floor"
    assert outcomes(ing) == {"ok:": 1}
    ready = asyncio.run(ing.ready())
    assert ready["ready"] is True and ready["floor_replicas"] == 1


def test_with_a_floor_a_request_goes_to_a_running_lent_replica_first(model):
    ing = ingress([Replica(model, "a")], running=("a",), floor=[FloorReplica(model, "f")])
    out = asyncio.run(ing.completions(Req({"prompt": "x", "max_tokens": 3})))
    assert out["served_by"] == "lent" and ing.floor.replicas and not ing.floor.replicas[0].jobs


def test_a_replica_the_arbiter_did_not_lend_gets_no_request_while_a_floor_answers(model):
    """Serve's cold-start rule starts a Generator replica by itself while requests wait at its handle; the
    arbiter (its count at 0) stops it. The fault this guards: forwarding to that replica queued requests at
    the handle again, and Serve started another -- 7 in 20 s during a demo's restart. With the arbiter's count
    at 0 (fillin.serve_tenant.TARGET_KEY) the floor answers; at 1, or unknown (no arbiter), the running
    replica does, as before."""
    for target, served_by in ((0, "floor"), (1, "lent"), (None, "lent")):
        ing = ingress([Replica(model, "a")], running=("a",), floor=[FloorReplica(model, "f")])
        ing.lent_target = target
        out = asyncio.run(ing.completions(Req({"prompt": "x", "max_tokens": 3})))
        assert out["served_by"] == served_by, (target, out["served_by"])
        assert ing.live == (0 if target == 0 else 1)
    # without a floor the count does not matter: the running replica is all there is
    ing = ingress([Replica(model, "a")], running=("a",))
    ing.lent_target = 0
    assert asyncio.run(ing.completions(Req({"prompt": "x", "max_tokens": 3})))["object"] == "text_completion"


def test_a_request_on_a_reclaimed_lent_replica_continues_on_the_floor(model):
    """The lent replica was told to stop (training claimed its GPU) and none other runs: the request moves
    to the floor and its text is the one it would have been."""
    body = {"prompt": "abc", "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stream": True}
    whole = asyncio.run(ingress([Replica(model, "z")]).completions(Req({**body, "stream": False})))
    floor = FloorReplica(model, "f")
    ing = ingress([Replica(model, "a")], running=("a",), floor=[floor])

    async def run():
        resp = await ing.completions(Req(body))
        events = []
        async for piece in resp.body_iterator:
            events.append(piece)
            if len(events) == 2:
                ing._set_running(0, [])           # replica a was told to stop; no lent replica left
        return events
    events = asyncio.run(run())
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text == whole["choices"][0]["text"]
    assert ing.continued.seen[(("why", "replica_stopped"),)] == 1 and len(floor.jobs) == 1


def test_a_request_on_the_floor_stays_there_when_lent_replicas_come_and_go(model):
    body = {"prompt": "abc", "max_tokens": 20, "temperature": 0, "ignore_eos": True, "stream": True}
    ing = ingress([Replica(model, "a")], running=(), states={}, floor=[FloorReplica(model, "f")])

    async def run():
        resp = await ing.completions(Req(body))
        events = []
        async for piece in resp.body_iterator:
            events.append(piece)
            if len(events) == 2:
                ing._set_running(1, ["a"])        # a lent replica came up meanwhile
            if len(events) == 4:
                ing._set_running(0, [])
        return events
    asyncio.run(run())
    assert not ing.continued.seen
