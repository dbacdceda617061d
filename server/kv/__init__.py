"""KV state: the torch-free block manager, the preallocated pool, KV events, and sequence
export/import."""
