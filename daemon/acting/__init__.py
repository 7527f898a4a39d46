"""Carrying a judgment out: a decision recorded, then done (decisions); what the watch asked for
(effects_of_watch); the seam to the other machines (`peers.Peers`) and its one-machine kind, `Alone`.
Imports the judging, records and processes rooms.
"""
