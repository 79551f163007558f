"""Offline tools that run the engine's own model: the SWA head finder (find_swa_heads)."""
