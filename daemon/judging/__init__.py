"""What judges a run, pure: no clock, files, sockets or processes (callers pass `now` and the data).

The watch (one generation's state machine), the detectors (health, hang, straggler, replicas), triage,
the policy and its incidents, the checkpoint cadence, the devices' quarantine, the operators' requests.
Imports nothing of the daemon's other rooms.
"""
