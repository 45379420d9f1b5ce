"""lm-evaluation-harness integration: the LM adapter, task resolution, eval.py and in-training evaluation."""
