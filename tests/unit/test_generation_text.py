"""Incremental text (UTF-8 hold-back, stop sequences across token boundaries) and sampling (top-p keeps the
smallest most-likely set, draws follow the distribution, randomness keyed by seed and token index)."""
import torch

from spotfill.generation import sampling
from spotfill.generation.text import ByteTokenizer, IncrementalText


def feed(text: IncrementalText, data: bytes):
    out, stopped = [], False
    for b in data:
        delta, stopped = text.add([b])
        out.append(delta)
        if stopped:
            break
    return out, stopped


def test_an_incomplete_utf8_character_is_held_back():
    t = IncrementalText(ByteTokenizer())
    deltas, _ = feed(t, "aé€b".encode())
    assert deltas == ["a", "", "é", "", "", "€", "b"]


def test_a_stop_sequence_split_over_tokens_is_cut_and_never_streamed():
    t = IncrementalText(ByteTokenizer(), stop=("END", "##"))
    deltas, stopped = feed(t, b"abc EN xyz E#ENDmore")
    assert stopped and "".join(deltas) + t.finish() == "abc EN xyz E#"
    assert all("END" not in d for d in deltas)


def test_held_back_tail_that_is_no_stop_is_released():
    t = IncrementalText(ByteTokenizer(), stop=("STOP",))
    deltas, stopped = feed(t, b"xST")
    assert not stopped and "".join(deltas) == "x"
    assert t.finish() == "ST"


def test_a_continued_text_starts_after_what_was_emitted():
    t = IncrementalText(ByteTokenizer(), stop=("!",), ids=list(b"hello wor"), emitted=9)
    deltas, stopped = feed(t, b"ld! more")
    assert stopped and "".join(deltas) == "ld" and t.text == "hello world"


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = sampling.probabilities(logits, torch.tensor([1.0]), torch.tensor([0.7]))
    assert torch.allclose(probs, torch.tensor([[0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]]))
    probs = sampling.probabilities(logits, torch.tensor([1.0]), torch.tensor([0.5]))
    assert torch.allclose(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_draws_follow_the_distribution_and_are_keyed_by_seed_and_index():
    probs = torch.tensor([[0.1, 0.6, 0.3]])
    n = 20000
    u = torch.tensor([sampling.uniform(11, i) for i in range(n)])
    drawn = sampling.draw(probs.expand(n, 3), u)
    freq = torch.bincount(drawn, minlength=3).float() / n
    assert torch.allclose(freq, probs[0], atol=0.015)
    assert sampling.uniform(3, 7) == sampling.uniform(3, 7)
    assert len({sampling.uniform(3, 7, s) for s in range(4)} | {sampling.uniform(4, 7), sampling.uniform(3, 8)}) == 6


def test_greedy_rows_take_the_argmax_and_sampled_rows_their_draw():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 5.0, 1.0]])
    params = [sampling.SamplingParams(), sampling.SamplingParams(temperature=100.0, seed=1)]
    picks = {int(sampling.choose(logits.clone(), params, [i, i])[0][1]) for i in range(50)}
    assert int(sampling.choose(logits.clone(), params, [0, 0])[0][0]) == 1 and len(picks) == 3
