"""Test setup for MindSpore's Ascend path on a machine without the Ascend toolkit: stand-in CANN
libraries (standins.py) that let MindSpore's Ascend plugin load and run its dry-run compile. Test-only:
nothing here is on a run's path, and nothing under engine/ or daemon/ knows about it."""
