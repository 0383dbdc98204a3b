"""Speculative decoding (draft -> verify) in the engine, on tiny models (CPU).

Greedy: the output is the target's own, token for token, with any draft -- the target's first layer
(self-speculative, shared cache), a different random model (most drafts rejected), the target itself (every
draft accepted: k + 1 tokens per verify step). Sampling: a chi-square test on a 3-token vocabulary shows the
output sequences follow the target's distribution, with a draft built to disagree with it."""
from __future__ import annotations

import copy

import pytest
import torch

from spotfill.generation.decoders import GPTDecoder, RecomputeDecoder
from spotfill.generation.engine import Engine, GenerationRequest
from spotfill.generation.sampling import SamplingParams
from spotfill.generation.spec_policy import FixedK, SpecPolicy
from spotfill.generation.text import ByteTokenizer
from spotfill.train.model import GPT, preset

PROMPTS = ["hello", "a", "the quick brown fox", "x" * 12, "zz", "abc def"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(preset("tiny")).eval()


@pytest.fixture(scope="module")
def other():
    torch.manual_seed(1)
    return GPT(preset("tiny")).eval()


def generate(target, prompts, draft=None, policy=None, max_batch=4, **params):
    eng = Engine(target, ByteTokenizer(), max_batch=max_batch, draft=draft, policy=policy)
    got: dict = {}
    for i, p in enumerate(prompts):
        prompt = list(p.encode()) if isinstance(p, str) else p
        eng.submit(GenerationRequest(str(i), prompt, SamplingParams(**{"seed": i, **params})),
                   lambda u: got.setdefault(u.request_id, []).append(u))
    while eng.step():
        pass
    return {k: ([t for u in v for t in u.ids], v[-1]) for k, v in got.items()}, eng


def tokens(out):
    return {k: v[0] for k, v in out.items()}


@pytest.fixture(scope="module")
def plain(model):
    return tokens(generate(GPTDecoder(model), PROMPTS, max_tokens=40, ignore_eos=True)[0])


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("draft_kind", ["self:1", "random", "target-copy"])
def test_greedy_output_is_the_targets_with_any_draft(model, other, plain, k, draft_kind):
    draft = {"self:1": lambda: GPTDecoder(model, layers=1), "random": lambda: GPTDecoder(other),
             "target-copy": lambda: GPTDecoder(copy.deepcopy(model))}[draft_kind]()
    out, eng = generate(GPTDecoder(model), PROMPTS, draft=draft, policy=FixedK(k), max_tokens=40,
                        ignore_eos=True)
    assert tokens(out) == plain
    assert eng.stats["speculative_steps"] > 0 and eng.stats["plain_steps"] == 0
    if draft_kind == "random":                                # the rejection path ran, often
        assert eng.stats["accepted"] < 0.5 * eng.stats["drafted"]
    if draft_kind == "target-copy":
        assert eng.stats["accepted"] == eng.stats["drafted"]


@pytest.mark.parametrize("k", [1, 3])
def test_draft_equal_to_target_gives_k_plus_one_tokens_per_verify_step(model, k):
    steps = 5
    for draft in (GPTDecoder(model), GPTDecoder(copy.deepcopy(model))):      # shared cache, own cache
        out, _ = generate(GPTDecoder(model), ["abc"], draft=draft, policy=FixedK(k),
                          max_tokens=1 + steps * (k + 1), ignore_eos=True)
        last = out["0"][1]
        assert (last.verify_steps, last.drafted, last.accepted) == (steps, steps * k, steps * k)
        assert last.completion_tokens == 1 + steps * (k + 1)


def test_adaptive_policy_keeps_greedy_output(model, plain):
    out, eng = generate(GPTDecoder(model), PROMPTS, draft=GPTDecoder(model, layers=1),
                        policy=SpecPolicy(max_k=4), max_tokens=40, ignore_eos=True)
    assert tokens(out) == plain


def test_greedy_rows_stay_exact_beside_sampled_rows(model, plain):
    eng = Engine(GPTDecoder(model), ByteTokenizer(), max_batch=8, draft=GPTDecoder(other_model(model)),
                 policy=FixedK(3))
    got: dict = {}
    for i, p in enumerate(PROMPTS):
        for kind, temp in (("g", 0.0), ("s", 1.0)):
            eng.submit(GenerationRequest(f"{kind}{i}", list(p.encode()),
                                         SamplingParams(max_tokens=40, temperature=temp, seed=i, ignore_eos=True)),
                       lambda u: got.setdefault(u.request_id, []).append(u))
    while eng.step():
        pass
    assert {k[1:]: [t for u in v for t in u.ids] for k, v in got.items() if k[0] == "g"} == plain


def other_model(model):
    torch.manual_seed(5)
    return GPT(model.cfg).eval()


# -- sampling: the output follows the target's distribution ------------------------------------------------
V = 3
P = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.45, 0.1, 0.45]])     # target: next token | previous
Q = torch.tensor([[0.05, 0.15, 0.8], [0.7, 0.25, 0.05], [0.1, 0.8, 0.1]])    # draft: built to disagree


class Bigram:
    """A decoder whose next-token distribution depends on the previous token only (exact probabilities to
    test against); no cache needed."""

    def __init__(self, table):
        self.logits, self.context, self.vocab_size = table.log(), 64, V

    def shares_cache_with(self, other):
        return False

    def new_cache(self, slots):
        return None

    def forward(self, cache, first_row, tokens, starts):
        return self.logits[torch.tensor(tokens)]

    @staticmethod
    def move(cache, src, dst, length):
        pass


def sequence_counts(draft, n, k=2, length=4):
    prompts = [[0]] * n
    out, eng = generate(Bigram(P), prompts, draft=draft, policy=FixedK(k) if draft else None, max_batch=64,
                        max_tokens=length, temperature=1.0)
    counts = torch.zeros([V] * length)
    for toks, _ in out.values():
        counts[tuple(toks)] += 1
    return counts, eng


def expected_probs(length=4):
    probs = torch.ones([V] * length)
    for idx in torch.cartesian_prod(*[torch.arange(V)] * length):
        p, last = 1.0, 0
        for t in idx.tolist():
            p *= float(P[last, t])
            last = t
        probs[tuple(idx.tolist())] = p
    return probs


def chi_square_p(counts, probs):
    """Pearson's chi-square test of the counts against the probabilities: the p-value (regularised upper
    incomplete gamma of the statistic, degrees of freedom = cells - 1)."""
    observed = counts.flatten().double()
    expected = probs.flatten().double() * observed.sum()
    stat = ((observed - expected) ** 2 / expected).sum()
    dof = torch.tensor((observed.numel() - 1) / 2.0, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))


def test_sampled_output_follows_the_target_distribution_with_a_disagreeing_draft():
    """4 tokens after the prompt (81 sequences), 8000 requests with seeds 0..7999: one verify step of k=2
    covers tokens 2-4, so the accept, the residual draw and the bonus token all count. The draft's own
    distribution (Q) and 'accept every draft' are far off the target's, so the test can fail."""
    probs = expected_probs()
    counts, eng = sequence_counts(Bigram(Q), 8000)
    assert 0.2 < eng.stats["accepted"] / eng.stats["drafted"] < 0.8      # both paths taken, often
    assert chi_square_p(counts, probs) > 1e-3


def test_the_chi_square_check_rejects_a_wrong_distribution():
    """The same check against sequences sampled without any draft but from the draft's table: p-value ~ 0."""
    out, _ = generate(Bigram(Q), [[0]] * 8000, max_batch=64, max_tokens=4, temperature=1.0)
    counts = torch.zeros([V] * 4)
    for toks, _ in out.values():
        counts[tuple(toks)] += 1
    assert chi_square_p(counts, expected_probs()) < 1e-6


# -- a draft with its own cache, after plain steps ----------------------------------------------------------
class StepClock:
    """A clock that advances one second per reading: every pass the engine times takes 1 s, so the adaptive
    policy's decisions follow from the acceptance rate alone (no timing in the test)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 1.0
        return self.now


class Scripted:
    """The policy interface with k taken from a script (0: a plain step), the script repeating; records each
    speculative step's batch size, k, judged and accepted drafts."""

    def __init__(self, script):
        self.script, self.i, self.spec_steps = list(script), 0, []
        self.acceptance, self.last_reason = None, "scripted"

    def record_plain(self, batch, seconds):
        pass

    def record_speculative(self, batch, k, draft_s, verify_s, checked, accepted):
        self.spec_steps.append((batch, k, checked, accepted))

    def decide(self, batch):
        k = self.script[self.i % len(self.script)]
        self.i += 1
        return k


def own_cache_draft(kind, model):
    """A draft that keeps its own cache: spotfill's GPT cached (a run's URI), or recomputed as a Hugging Face
    draft is (RecomputeDecoder)."""
    if kind == "gpt":
        return GPTDecoder(model)
    return RecomputeDecoder(model, model.cfg.seq_len, model.cfg.vocab_size)


@pytest.mark.parametrize("kind", ["gpt", "recompute"])
def test_a_disagreeing_draft_with_its_own_cache_under_the_adaptive_policy_keeps_every_request(model, plain, kind):
    """The draft's proposals are mostly rejected, so the adaptive policy switches speculation off and probes
    after plain steps; the draft's cache must catch up on the tokens it did not see (its probe once failed
    every running request: IndexError from a recomputed draft's empty context)."""
    policy = SpecPolicy(max_k=4)
    eng = Engine(GPTDecoder(model), ByteTokenizer(), max_batch=4, draft=own_cache_draft(kind, other_model(model)),
                 policy=policy, clock=StepClock())
    got: dict = {}
    for i, p in enumerate(PROMPTS):
        eng.submit(GenerationRequest(str(i), list(p.encode()), SamplingParams(max_tokens=40, ignore_eos=True)),
                   lambda u: got.setdefault(u.request_id, []).append(u))
    while eng.step():
        pass
    assert {k: v[-1].finish_reason for k, v in got.items()} == {str(i): "length" for i in range(len(PROMPTS))}
    assert {k: [t for u in v for t in u.ids] for k, v in got.items()} == plain
    assert eng.stats["speculative_steps"] >= 3 and eng.stats["plain_steps"] >= 20     # off, then probes
    assert eng.stats["draft_catch_up"] > 0


@pytest.mark.parametrize("kind", ["gpt", "recompute"])
def test_a_draft_equal_to_the_target_with_its_own_cache_accepts_everything_after_plain_steps(model, kind):
    """The same weights in a separate model object (its own cache): every drafted token is accepted on every
    speculative step, including those after one, two and five plain steps in a row and after a step that
    kept all k drafts."""
    policy = Scripted([0, 0, 3, 0, 2, 2, 0, 0, 0, 0, 0, 4, 1, 1, 0])
    eng = Engine(GPTDecoder(model), ByteTokenizer(), max_batch=4,
                 draft=own_cache_draft(kind, copy.deepcopy(model)), policy=policy)
    got: dict = {}
    for i, p in enumerate(PROMPTS):
        eng.submit(GenerationRequest(str(i), list(p.encode()), SamplingParams(max_tokens=60, ignore_eos=True)),
                   lambda u: got.setdefault(u.request_id, []).append(u))
    while eng.step():
        pass
    assert len(policy.spec_steps) >= 10 and eng.stats["plain_steps"] >= 10
    assert [(c, a) for _, _, c, a in policy.spec_steps] == [(n * k, n * k) for n, k, _, _ in policy.spec_steps]
    assert eng.stats["accepted"] == eng.stats["drafted"]
