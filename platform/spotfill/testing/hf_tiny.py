"""A tiny random Hugging Face Llama and a BPE tokenizer trained here, for tests and benchmarks that need a
real `hf:` model offline (nothing downloads): `tiny_llama(folder)` writes both with save_pretrained.

The tokenizer: byte-level BPE trained with `tokenizers` on `text` (default: a few sentences), `<s>` as BOS
(added to every encoded prompt, as Llama's tokenizer does), `</s>` as EOS, and a chat template in the
shape of Llama-2's/Zephyr's (`<|role|>\\ncontent</s>` per message, then `<|assistant|>\\n`)."""
from __future__ import annotations

import os

TEXT = ("the quick brown fox jumps over the lazy dog. " * 20 + "spotfill lends spare GPUs to fill-in work. " * 20
        + "un café, s'il vous plaît — naïve façade. " * 10)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def tiny_tokenizer(folder: str, text: str = TEXT, vocab_size: int = 300, chat_template: bool = True):
    """A byte-level BPE tokenizer saved to `folder`; returns the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def tiny_llama(folder: str, layers: int = 2, seed: int = 0, text: str = TEXT, context: int = 128,
               chat_template: bool = True) -> tuple[str, str]:
    """(model folder, tokenizer folder) under `folder`: a random `layers`-layer Llama over tiny_tokenizer."""
    import torch
    import transformers

    tok_dir, model_dir = os.path.join(folder, "tok"), os.path.join(folder, "llama")
    fast = tiny_tokenizer(tok_dir, text, chat_template=chat_template)
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=context, bos_token_id=fast.bos_token_id,
                                   eos_token_id=fast.eos_token_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(model_dir)
    return model_dir, tok_dir
