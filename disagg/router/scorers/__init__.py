"""Scorers: ``score(ctx, workers) -> {worker_id: float in [0, 1]}``."""
