"""Filters: ``filter(ctx, workers) -> workers`` (a subset, never reordered)."""
