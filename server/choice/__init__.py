"""Token choice on the executor: validation, the seeded draw, speculative acceptance."""
