"""Text generation: KV-cached decoding with continuous batching, sampling, stop sequences and speculative
decoding (pure torch, no Ray; the Serve app in spotfill/serving/app.py is a thin layer over it).

  decoders.py     a model behind one interface: spotfill's GPT with a slot KV cache, or any
                  `forward(idx) -> logits` model recomputed (a Hugging Face model, a test model)
  sampling.py     greedy / temperature / top-p, reproducible from (seed, token index) alone
  text.py         byte-level tokenizer, incremental text with stop sequences and UTF-8 hold-back
  speculative.py  draft -> verify: the acceptance rule (greedy-exact; sampled: Leviathan et al. 2023)
  spec_policy.py  how many tokens to draft now, or none (pure: measured costs and acceptance)
  engine.py       the scheduler: requests join the running batch at the next step and leave when done
  offline.py      a list of prompts through an engine stepped in the caller's thread (the batch job)
  protocol.py     the OpenAI-compatible request/response shapes (pure)
  relay.py        a request that outlives its replica: continue elsewhere from the tokens generated
"""
