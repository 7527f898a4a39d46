"""The ranks' processes and their files: a generation's processes and signals, the warm standby, memory
cgroups, MindSpore's environment, a rank's log, the run's lock, the files a generation is handed, the
control directory. Imports the judging and records rooms.
"""
