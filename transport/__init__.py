"""KV connectors: move whole KV blocks between instances (NIXL over UCX, and an in-process
loopback for tests). Reached through the plugin manager, never imported by the engine."""
