"""The scheduler side of the engine: requests, sampling params, block pool, KV manager, scheduler.

Pure Python: nothing under ``tandem.sched`` imports torch, so its tests are fast and exact.
"""
