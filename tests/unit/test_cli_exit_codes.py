"""main() turns every outcome into a documented exit code (contracts.protocol.ExitCode)."""
import pytest

from cli import main as cli_main
from contracts.protocol import ExitCode


def test_unforeseen_exception_is_an_internal_error(monkeypatch, capsys):
    def broken(args):
        raise RuntimeError("disk on fire")

    monkeypatch.setitem(cli_main.COMMANDS, "config", broken)
    assert cli_main.main(["config"]) == ExitCode.INTERNAL_ERROR == 70
    err = capsys.readouterr().err
    assert "disk on fire" in err and "internal error" in err


def test_config_error_is_78_and_one_line(capsys):
    assert cli_main.main(["config", "--set", "train.steps=0"]) == ExitCode.CONFIG_ERROR
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["llm-pretrain: config error: train.steps = 0 is out of range; it must be >= 1"]


def test_usage_error_is_2():
    with pytest.raises(SystemExit) as info:
        cli_main.main(["no-such-command"])
    assert info.value.code == ExitCode.USAGE


def test_help_lists_every_exit_code_and_version_answers(capsys):
    import pytest

    from cli.main import build_parser
    from contracts.protocol import ExitCode

    text = build_parser().format_help()
    assert all(f"  {int(c):>3}  " in text for c in ExitCode)
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("llm-pretrain ")
