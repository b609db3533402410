"""Request admission and batching: the scheduler, requests, KV slots, static batches."""
