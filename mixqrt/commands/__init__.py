"""The measuring and diagnosing commands: bench, evaluate (perplexity, KL), doctor, inspect_model."""
