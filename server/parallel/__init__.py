"""Tensor parallelism: the sharded runner over torch.distributed, and token choice across
the ranks' vocabulary slices."""
