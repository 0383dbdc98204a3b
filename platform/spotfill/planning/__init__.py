"""Planning: memory, compute, time, cost and IO for a training run; DeepSpeed config (pure)."""
