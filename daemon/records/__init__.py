"""What the run records and tells: its state (`RunState`, changed by the ledger alone), state.json,
the rebuild from the event log, the event log, metrics, sd_notify. Imports the judging room only.
"""
