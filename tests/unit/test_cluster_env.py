"""The environment of MindSpore's dynamic-cluster processes, as the daemon hands it over."""
from daemon import cluster


def test_cluster_processes_heartbeat_every_second_unless_the_operator_says_otherwise():
    env = cluster.process_env({}, role=cluster.WORKER, sched_host="h", sched_port=1, worker_num=2, local_worker_num=2,
                              node_id=1)
    assert (env["MS_RETRY_INTERVAL_LOWER"], env["MS_RETRY_INTERVAL_UPPER"], env["MS_NODE_ID"]) == ("1", "1", "1")
    own = cluster.process_env({"MS_RETRY_INTERVAL_LOWER": "3", "MS_RETRY_INTERVAL_UPPER": "5"}, role=cluster.SCHEDULER,
                              sched_host="h", sched_port=1, worker_num=2, local_worker_num=2)
    assert (own["MS_RETRY_INTERVAL_LOWER"], own["MS_RETRY_INTERVAL_UPPER"]) == ("3", "5") and "MS_NODE_ID" not in own
