"""`spotfill serve --checkpoint URI --port N` for real (a subprocess with its own embedded cluster), driven by
the official `openai` client, and `spotfill status --address` against the same cluster."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from spotfill.testing.ports import free_port  # noqa: F401  (test_serve_hf, test_hf_end_to_end import it here)

pytestmark = pytest.mark.timeout(300)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def module_checkpoint(uri: str, step: int) -> None:
    """A committed checkpoint with DeepSpeed's module-states file only (no ZeRO shards)."""
    import torch

    from spotfill.storage.base import open_storage
    from spotfill.storage.checkpoint_store import CheckpointStore, tag_for
    from spotfill.train.model import build_model
    torch.manual_seed(step)
    store = CheckpointStore(open_storage(uri))
    local = uri[len("file://"):] + "-part"
    os.makedirs(local)
    torch.save({"module": build_model("tiny").state_dict()}, os.path.join(local, "mp_rank_00_model_states.pt"))
    store.upload_part(tag_for(step), 0, 1, local)
    store.commit(tag_for(step), step, 1)


def stop_serve(proc) -> None:
    """Stop a `spotfill serve` subprocess as Ctrl-C does (its process group killed if it hangs)."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def ready_state(url: str) -> str | None:
    """What /-/ready says ("ready", or why not); None while the proxy or the app's route is not up yet."""
    try:
        with urllib.request.urlopen(url + "/-/ready", timeout=10) as resp:
            return json.loads(resp.read())["state"]
    except urllib.error.HTTPError as exc:       # 503 until a replica runs, with the reason
        try:
            return json.loads(exc.read())["state"] if exc.code == 503 else None
        except ValueError:                      # Serve's proxy before the app's route exists
            return None
    except OSError:
        return None


def first_completion(url: str, t_max: float = 120.0) -> dict:
    """The first completion, sent as soon as the app answers at all -- while the Generator replica the
    arbiter lends is still starting -- and never retried: what /-/ready said just before it, the HTTP status
    and body, and the seconds it took."""
    t_end = time.monotonic() + t_max
    state = ready_state(url)
    while state is None and time.monotonic() < t_end:
        time.sleep(0.1)
        state = ready_state(url)
    body = json.dumps({"model": "spotfill", "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
    req = urllib.request.Request(url + "/v1/completions", data=body.encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=t_max) as resp:
            status, answer = resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        status, answer = exc.code, exc.read().decode(errors="replace")
    return {"ready_before": state, "status": status, "answer": answer, "seconds": round(time.monotonic() - t0, 2)}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    uri = f"file://{tmp_path_factory.mktemp('run')}/run"
    module_checkpoint(uri, 5)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "platform")}
    proc = subprocess.Popen([sys.executable, "-m", "spotfill", "serve", "--checkpoint", uri, "--port", str(port),
                             "--nodes", "1", "--max-queue-wait-s", "90"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    banner, seen = "", []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("spotfill serve:"):
                banner = line
                break
        assert banner, "spotfill serve did not start:\n" + "".join(seen[-30:])
        url = f"http://127.0.0.1:{port}"
        first = first_completion(url)
        states = []
        t_end = time.monotonic() + 120
        while time.monotonic() < t_end:
            state = ready_state(url)
            if state == "ready":
                break
            if state is not None:      # 503 until a replica runs: say why
                states.append(state)
            time.sleep(0.5)
        else:
            raise AssertionError(f"no Generator replica came up on the lent GPU slot: {states[-5:]}")
        assert set(states) <= {"no_replica_lent", "replica_starting", "no_checkpoint"}, states
        yield {"url": url, "banner": banner, "proc": proc, "first": first}
    finally:
        stop_serve(proc)


def test_the_first_completion_waits_for_the_replica_starting_instead_of_a_503(served):
    """No client retries: the completion sent while the lent GPU's replica still starts waits for it (in
    the app's bounded queue, --max-queue-wait-s) and is answered."""
    first = served["first"]
    assert first["ready_before"] in ("no_replica_lent", "replica_starting", "no_checkpoint"), first  # no replica yet
    assert first["status"] == 200, first
    assert first["answer"]["checkpoint"] == {"tag": "step-00000005", "step": 5}, first
    assert first["answer"]["usage"]["completion_tokens"] >= 1, first


def test_openai_client_completions(served):
    from openai import OpenAI

    client = OpenAI(base_url=served["url"] + "/v1", api_key="not-needed", max_retries=0, timeout=30)
    out = client.completions.create(model="spotfill", prompt="Once upon a time", max_tokens=8)
    assert out.object == "text_completion" and len(out.choices) == 1
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == len("Once upon a time") and 0 <= out.usage.completion_tokens <= 8
    assert out.model_extra["checkpoint"] == {"tag": "step-00000005", "step": 5}
    models = client.models.list().data
    assert [m.id for m in models] == ["spotfill"]
    assert models[0].model_extra["ready"] is True and models[0].model_extra["checkpoint"] == "step-00000005"


def test_openai_client_streams_a_chat_completion(served):
    """The official client streams a chat completion (server-sent events) from the replica: the streamed
    pieces add up to the same text as the whole answer (greedy), the last chunk has the usage."""
    from openai import OpenAI

    client = OpenAI(base_url=served["url"] + "/v1", api_key="not-needed", max_retries=0, timeout=60)
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def fib(n):"}]
    whole = client.chat.completions.create(model="spotfill", messages=messages, max_tokens=24, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    pieces, finish, usage, roles = [], None, None, []
    for chunk in client.chat.completions.create(model="spotfill", messages=messages, max_tokens=24, temperature=0,
                                                stream=True, stream_options={"include_usage": True}):
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            roles += [choice.delta.role] if choice.delta.role else []
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert roles == ["assistant"] and len([p for p in pieces if p]) > 1
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason in ("length", "stop")
    assert usage.completion_tokens == whole.usage.completion_tokens and usage.prompt_tokens == whole.usage.prompt_tokens


def test_streamed_completion_and_errors_in_openais_shape(served):
    import openai
    from openai import OpenAI

    client = OpenAI(base_url=served["url"] + "/v1", api_key="not-needed", max_retries=0, timeout=60)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="spotfill", prompt="abc", max_tokens=12, temperature=0, stream=True))
    assert text == client.completions.create(model="spotfill", prompt="abc", max_tokens=12, temperature=0).choices[0].text
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="spotfill", prompt="abc", max_tokens=4, n=2)
    assert bad.value.status_code == 400 and bad.value.response.json()["error"]["param"] == "n"
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="spotfill", prompt="x" * 100, max_tokens=4)
    assert long.value.response.json()["error"]["code"] == "context_length_exceeded"


def test_status_reads_the_arbiter(served):
    address = re.search(r"--address (\S+)`", served["banner"]).group(1)
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "platform")}
    out = subprocess.run([sys.executable, "-m", "spotfill", "status", "--address", address], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "leases (1):" in out.stdout and "serve:spotfill-serve/Generator" in out.stdout
    # the replica Serve deployed with is adopted, or the free slot lent to a new one
    assert re.search(r"(lend +serve:spotfill-serve/Generator 1 GPU on \w+ -- 1 free GPU|"
                     r"adopt +serve:spotfill-serve/Generator 1 GPU on \w+ -- tenant holds)", out.stdout), out.stdout
    js = subprocess.run([sys.executable, "-m", "spotfill", "status", "--address", address, "--json"], env=env,
                        capture_output=True, text=True, timeout=120)
    assert json.loads(js.stdout)["leases"][0]["kind"] == "serve"
