"""Test helpers shared across the suite: tiny HF checkpoints (tiny_models) and paged batches
(paged_batch)."""
