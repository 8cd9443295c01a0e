"""Adapters for agent frameworks and model SDKs: they build flows, never touch the database."""
