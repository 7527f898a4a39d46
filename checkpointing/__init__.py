"""Sharded asynchronous checkpoints (named numpy arrays + JSON metadata).

Imports neither `daemon` nor `engine`.
"""
