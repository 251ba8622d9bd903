"""Registers the built-in KV connectors."""
