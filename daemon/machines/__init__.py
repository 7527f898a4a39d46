"""Several machines, one daemon each, agreeing through etcd: the leadership core (pure), membership,
the coordinator (election, leases, fencing), the generation handshake, the decision exchange, the
run's keys, the etcd client and the embedded etcd; `nodes.Nodes` composes them as the supervisor's
`Peers`. Imports every other room of the daemon; only the supervisor imports it.
"""
