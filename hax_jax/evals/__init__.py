"""Evaluation tasks: joint recall, MQAR, RULER-style, perplexity, LongBench,
lm-evaluation-harness."""
