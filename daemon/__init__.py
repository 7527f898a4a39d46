"""The supervisor: runs the engine's ranks, watches them, applies the recovery policy.

Never imports MindSpore or engine internals (only `contracts.config`).
"""
