"""The relay (spotfill/generation/relay.py): a request whose replica is lost or stopped mid-generation goes
on from the tokens generated so far on another replica, as one stream; a request no replica took was never
admitted; one that cannot be continued in the queue bound is lost. Replicas are stand-ins running the real
engine on a tiny model, so the continuation's tokens are real."""
import asyncio

import pytest
import torch

from spotfill.generation.relay import Lost, NotAdmitted, Relay
from spotfill.generation.replica import build_engine, job_request, stream_job
from spotfill.train.model import GPT, preset


class Died(Exception):
    """Stands in for RayActorError."""


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(preset("tiny")).eval()


class Replica:
    """A replica answering jobs with the real engine; `die_after` chunks it raises Died (its node died)."""

    def __init__(self, model, name, die_after=None, admit=True, error=Died):
        self.model, self.name, self.die_after, self.admit, self.error = model, name, die_after, admit, error
        self.jobs = []

    def open(self, job):
        self.jobs.append(job)
        return Stream(self, job)


class Stream:
    def __init__(self, replica, job):
        self.replica, self.job, self.cancelled = replica, job, False
        self._gen = self._run()

    async def _run(self):
        r = self.replica
        if not r.admit:
            await asyncio.sleep(3600)
        engine = build_engine(r.model).start()
        try:
            yield {"admitted": True, "replica": r.name, "checkpoint": {"tag": "t"},
                   **({"floor": True} if getattr(r, "floor", False) else {})}
            n = 0
            async for c in stream_job(engine, job_request(self.job, engine.tokenizer, r.model.cfg.seq_len)):
                if self.cancelled:
                    raise RuntimeError("RequestCancelledError")
                if r.die_after is not None and n >= r.die_after:
                    raise r.error()
                n += 1
                yield c
                await asyncio.sleep(0)
        finally:
            engine.stop()

    def cancel(self):
        self.cancelled = True

    def __aiter__(self):
        return self._gen


def route(*replicas):
    """open_stream sending each attempt to the next replica."""
    queue = list(replicas)
    return lambda job: queue.pop(0).open(job)


def relay_for(open_stream, ready=True, placeable=True, **params):
    async def replica_ready():
        return ready
    job = {"request_id": "r", "prompt": "def f(x):", "params": {"max_tokens": 30, "temperature": 0.0,
                                                                 "seed": 5, "ignore_eos": True, **params}}
    return Relay(job, open_stream, is_lost=lambda e: isinstance(e, Died), replica_ready=replica_ready,
                 placeable=lambda: placeable, admit_timeout_s=0.5)


async def drain(relay):
    return [c async for c in relay]


def text_and_ids(chunks):
    return "".join(c["text"] for c in chunks), [t for c in chunks for t in c["ids"]]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_lost_replicas_request_continues_elsewhere_as_one_stream(model, temperature):
    whole = asyncio.run(drain(relay_for(route(Replica(model, "a")), temperature=temperature)))
    relay = relay_for(route(Replica(model, "a", die_after=4), Replica(model, "b")), temperature=temperature)
    cut = asyncio.run(drain(relay))
    assert text_and_ids(cut) == text_and_ids(whole) and len(text_and_ids(whole)[1]) == 30
    assert [c["why"] for c in relay.continuations] == ["its replica was lost (Died)"]
    assert relay.continuations[0]["after_tokens"] > 0 and relay.replica == "b"
    second_job = relay.next_job()
    assert second_job["params"]["seed"] == 5 and cut[-1]["completion_tokens"] == 30


def test_a_stopped_replicas_request_is_migrated(model):
    a, b = Replica(model, "a"), Replica(model, "b")
    relay = relay_for(route(a, b))

    async def run():
        out = []
        async for c in relay:
            out.append(c)
            if len(out) == 3:
                assert relay.migrate()           # the Ingress saw replica a leave the running set
        return out
    chunks = asyncio.run(run())
    whole = asyncio.run(drain(relay_for(route(Replica(model, "c")))))
    assert text_and_ids(chunks) == text_and_ids(whole)
    assert relay.continuations[0]["why"] == "its replica was stopped (GPU reclaimed)"
    assert b.jobs[0]["generated"] and len(b.jobs[0]["generated"]) == len([t for c in chunks[:3] for t in c["ids"]])


def test_no_replica_to_continue_on_within_the_bound_is_lost_not_refused(model):
    relay = relay_for(route(Replica(model, "a", die_after=2)), ready=False)
    with pytest.raises(Lost, match="lost after"):
        asyncio.run(drain(relay))


def test_a_request_no_replica_took_was_never_admitted(model):
    relay = relay_for(route(Replica(model, "a", admit=False)), placeable=False)
    with pytest.raises(NotAdmitted):
        asyncio.run(drain(relay))
    assert not relay.admitted


def test_an_error_that_is_not_a_lost_replica_is_not_retried(model):
    class Broken(Replica):
        def open(self, job):
            raise ValueError("bad job")
    with pytest.raises(ValueError):
        asyncio.run(drain(relay_for(route(Broken(model, "x"), Replica(model, "y")))))


def test_a_client_that_stops_listening_cancels_the_replicas_work(model):
    a = Replica(model, "a")
    relay = relay_for(route(a))

    async def run():
        it = relay.__aiter__()
        await it.__anext__()
        await it.aclose()                        # the client disconnected after the first chunk
    asyncio.run(run())
    assert relay._stream.cancelled
