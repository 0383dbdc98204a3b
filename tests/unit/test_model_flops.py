"""FLOPs per trained token of spotfill's GPT presets (the MFU numerator), against PaLM App. B worked by hand.

PaLM counts matmul FLOPs: 6N + 12*L*h*s per token, N the parameters that enter a matmul. GPT's token
embedding wte (vocab x h) and position table wpe (seq_len x h) are lookups, not matmuls; its output layer
is a matrix of its own (vocab x h, no bias), which is. Per block, by hand: qkv 3h^2 + 3h, proj h^2 + h,
MLP 4h^2 + 4h and 4h^2 + h, two LayerNorms 4h: 12h^2 + 13h; then the final LayerNorm 2h and the head.
"""
import pytest

torch = pytest.importorskip("torch")

from spotfill.train.model import GPT, count_params, model_flops  # noqa: E402
from spotfill.config.presets import preset  # noqa: E402


def _params(name: str) -> int:
    with torch.device("meta"):                 # the shapes only: no 1.2B parameters in memory
        return count_params(GPT(preset(name)))


@pytest.mark.parametrize("name,n,attention,total", [
    # 125m: h 768, L 12, V 32000, s 1024. N = 12 x (12 x 768^2 + 13 x 768) + 2 x 768 + 32000 x 768
    #     = 85,054,464 + 1,536 + 24,576,000 = 109,632,000; 12 x 12 x 768 x 1024 = 113,246,208
    ("125m", 109_632_000, 113_246_208, 771_038_208),
    # 1b: h 2048, L 22, V 32000, s 2048. N = 22 x 50,358,272 + 4,096 + 65,536,000 = 1,173,422,080;
    #     12 x 22 x 2048 x 2048 = 1,107,296,256
    ("1b", 1_173_422_080, 1_107_296_256, 8_147_828_736),
])
def test_model_flops_count_matmuls_not_embedding_lookups(name, n, attention, total):
    cfg = preset(name)
    assert 6 * n + attention == total
    params = _params(name)
    assert params == n + cfg.vocab_size * cfg.n_embd + cfg.seq_len * cfg.n_embd     # the lookups are the rest
    model, hardware = model_flops(cfg, params)
    assert model == total and hardware == total                                      # no recompute: HFU == MFU


def test_the_planner_counts_the_same_model_the_same_way():
    """`spotfill plan` for the 1b preset's shape (untied, no position table in a derived architecture) and
    the measured MFU's FLOPs agree once the position table is given: the planner's N for the same model."""
    from spotfill.planning.architecture import Arch
    from spotfill.planning.sizing import flops_per_token

    cfg = preset("1b")
    arch = Arch(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head, 4 * cfg.n_embd, cfg.vocab_size, "gelu", "1b",
                positions=cfg.seq_len)
    assert flops_per_token(_params("1b"), arch, cfg.seq_len) == model_flops(cfg, _params("1b"))
