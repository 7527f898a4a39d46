"""`llm-pretrain chaos`: a soak that drives random real faults into a running run and reports
how the daemon detected and recovered from each. A client of the run like the CLI — it reads the
run's files and sends the faults an operator's bad night would (kill -9, SIGSTOP, a full disk, a
dead daemon, drills through the control directory) — never a part of the daemon."""
