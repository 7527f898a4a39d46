"""The design's import rules, checked on the source: imports flow one way."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _imports(path: Path) -> set[str]:
    """Top-level module names imported anywhere in the file (module level or inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _module_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _files(package: str):
    return sorted((ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", _files("daemon"), ids=lambda p: p.name)
def test_daemon_never_imports_mindspore_at_module_level_nor_engine_internals(path):
    for name in _module_level_imports(path):
        assert not name.startswith("mindspore"), f"{path.name} imports {name}"
        # engine.config and engine.elastic (a run's shape on fewer nodes) are pure: the daemon and the
        # config's own validation share them
        assert not name.startswith("engine") or name in ("engine.config", "engine.elastic"), \
            f"{path.name} imports {name}"


@pytest.mark.parametrize("path", _files("checkpointing"), ids=lambda p: p.name)
def test_checkpointing_imports_neither_daemon_nor_engine(path):
    for name in _imports(path):
        assert not name.startswith(("daemon", "engine")), f"{path.name} imports {name}"


def test_protocol_is_stdlib_only():
    import sys
    for name in _imports(ROOT / "daemon" / "protocol.py"):
        assert name.split(".")[0] in sys.stdlib_module_names or name == "__future__", name


@pytest.mark.parametrize("name", ["__init__.py", "config.py", "schedule.py", "data.py", "parallel.py", "memory_model.py",
                                  "plan.py", "dry_run.py"])
def test_engine_modules_the_supervisor_may_load_do_not_import_mindspore(name):
    assert not any(n.startswith("mindspore") for n in _imports(ROOT / "engine" / name))


@pytest.mark.parametrize("path", _files("engine"), ids=lambda p: p.name)
def test_engine_imports_no_daemon_module_but_protocol(path):
    for name in _imports(path):
        assert not name.startswith("daemon") or name == "daemon.protocol", f"{path.name} imports {name}"


def test_durable_is_stdlib_only():
    import sys
    for name in _imports(ROOT / "durable" / "__init__.py"):
        assert name.split(".")[0] in sys.stdlib_module_names or name == "__future__", name


def test_one_atomic_writer_in_the_tree():
    """Every atomic replace goes through durable.write_atomically: one definition site of os.replace."""
    sites = [p.relative_to(ROOT).as_posix() for pkg in ("daemon", "engine", "checkpointing", "durable")
             for p in _files(pkg) if "os.replace(" in p.read_text()]
    assert sites == ["durable/__init__.py"], sites


def test_the_supervisor_stays_a_small_loop_and_no_daemon_function_grows_past_60_lines():
    # 250 before multi-node; what a run across machines changes lives in daemon/peers.py, the loop keeps its call
    # sites; so for the warm standby (daemon/standby.py), whose four call sites made it 261
    assert len((ROOT / "daemon" / "supervisor.py").read_text().splitlines()) <= 262
    long = [f"{path.name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)" for path in _files("daemon")
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 60]
    assert long == []


def test_the_policy_decides_on_typed_incidents_not_dicts():
    import inspect

    from daemon import policy
    from daemon.incidents import Incident

    params = inspect.signature(policy.decide, eval_str=True).parameters
    assert params["incident"].annotation is Incident
    assert "dict" not in str(inspect.signature(policy.decide))


@pytest.mark.parametrize("name", ["watch.py", "policy.py", "health.py", "hang.py", "incidents.py", "straggler.py"])
def test_the_deciding_modules_are_pure(name):
    """No clock, no processes, no files, no sockets in what decides: tests drive it with literal times."""
    banned = {"time", "os", "subprocess", "socket", "signal", "threading", "pathlib", "shutil"}
    used = {n.split(".")[0] for n in _imports(ROOT / "daemon" / name)}
    assert not used & (banned - ({"signal"} if name == "watch.py" else set())), used & banned


def test_only_the_generation_module_sends_signals():
    import re

    sending = re.compile(r"os\.killpg\(|os\.kill\((?![^)]*,\s*0\))|\.send_signal\(|\.terminate\(\)")
    senders = [p.name for p in _files("daemon") if sending.search(p.read_text())]
    assert senders == ["generation.py"], senders


def test_the_soak_is_a_client_no_daemon_module_but_the_cli_imports_it():
    importers = [p.name for p in _files("daemon") if any(n.split(".")[0] == "chaos" for n in _imports(p))]
    assert importers == ["cli.py"], importers
