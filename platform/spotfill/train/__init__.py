"""Elastic DeepSpeed training on Ray Train: batching, data, model, worker loop, TrainingJob."""
