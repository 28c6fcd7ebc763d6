"""Dynamic batching: ``batcher`` (a model's queue and inference thread) and ``merging`` (what one run takes and its
types: ``Request``, ``Run``, ``Outputs``, ``Timings``, which requests of different lengths join)."""
