"""Runs requests: the model worker thread, the scheduler's policy, the executor that plans
and runs forwards, prompts in parts, and the forward's per-sequence steps."""
