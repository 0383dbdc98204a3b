"""The speculative-decoding policy (pure): k follows the acceptance rate, speculation switches itself off
when verifying stops being cheap (a large batch) and probes rarely enough to cost under 5%, and comes back
when it pays again. Step times are a model of a GPU: a target pass costs `base` while memory-bound and grows
with the tokens it processes once compute-bound."""
from spotfill.generation.spec_policy import SpecPolicy, bucket, expected_tokens


def test_expected_tokens_per_verify_step():
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.0, 4) == 1.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    assert expected_tokens(0.8, 0) == 1.0


def target_s(batch, tokens_each, base=0.010, per_token=0.0004, knee=16):
    """Seconds of one target pass over `tokens_each` tokens per request."""
    work = batch * tokens_each
    return base if work <= knee else base + per_token * (work - knee)


def drive(policy, batch, acceptance, steps, draft_s=0.001):
    """Run `steps` decisions at a batch size with a draft accepted at `acceptance`; returns the k chosen
    and the time spent against plain decoding for the same tokens."""
    ks, spent, tokens = [], 0.0, 0.0
    for _ in range(steps):
        k = policy.decide(batch)
        ks.append(k)
        if k == 0:
            s = target_s(batch, 1)
            policy.record_plain(batch, s)
            spent, tokens = spent + s, tokens + batch
        else:
            v = target_s(batch, k + 1)
            policy.record_speculative(batch, k, draft_s * k, v, batch * k, round(batch * k * acceptance))
            spent += draft_s * k + v
            tokens += batch * expected_tokens(acceptance, k)
    plain = tokens / batch * target_s(batch, 1)
    return ks, spent / plain


def test_k_grows_with_the_acceptance_rate_and_falls_with_it():
    p = SpecPolicy(max_k=8)
    high, _ = drive(p, 1, 0.9, 40)
    assert high[-1] >= 6
    low, _ = drive(p, 1, 0.3, 40)
    assert 1 <= low[-1] <= 2
    back, _ = drive(p, 1, 0.9, 40)
    assert back[-1] >= 6


def test_high_load_switches_speculation_off_and_costs_under_5_percent():
    p = SpecPolicy(max_k=4)
    ks, cost = drive(p, 64, 0.7, 2000)
    assert ks[-200:].count(0) >= 195, ks[-200:]
    assert cost < 1.05, cost
    # load drops: at batch 1 it pays again and is on
    ks1, cost1 = drive(p, 1, 0.7, 50)
    assert ks1[-1] > 0 and cost1 < 1.0


def test_a_useless_draft_is_switched_off():
    p = SpecPolicy(max_k=4)
    ks, cost = drive(p, 1, 0.05, 2000, draft_s=0.004)
    assert ks[-100:].count(0) >= 95 and cost < 1.05


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]


def test_probing_stays_within_its_budget_from_the_first_decision():
    """Once a plain and a speculative step are measured, probes wait long enough for their predicted extra
    cost that probing adds under 5% right away (not only after many doublings)."""
    p = SpecPolicy(max_k=4)
    drive(p, 64, 0.1, 2, draft_s=0.03)           # one plain, one speculative step measured: a draft as
    for steps in (60, 300):                       # costly as the model, under load
        ks, cost = drive(p, 64, 0.1, steps, draft_s=0.03)
        assert ks.count(0) >= 0.97 * steps and cost < 1.05, (steps, ks.count(0), cost)


def test_a_plain_step_measured_during_a_stall_does_not_keep_speculation_on():
    """One plain step took 50x its time (the process was descheduled): speculation looks worth it and turns
    on, but plain steps are measured again now and then, and a useless draft is switched off."""
    p = SpecPolicy(max_k=4)
    p.record_plain(1, 0.5)                        # a stall: a plain step really takes 0.01 s
    ks, _ = drive(p, 1, 0.05, 400, draft_s=0.004)
    assert ks[0] > 0                              # fooled at first
    assert ks[-100:].count(0) >= 95, ks[-100:]
