"""The supervisor: runs the engine's ranks, watches them, applies the recovery policy.

In rooms, each importing only those before it: judging (pure) ← records ← processes ← acting ←
machines ← supervisor (the loop). Never imports MindSpore or the engine (only `contracts`).
"""
