"""Integrations of Lins with training frameworks (each imported on demand)."""
