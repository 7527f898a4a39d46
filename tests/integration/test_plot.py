"""`llm-pretrain plot` on a run with a rolled-back spike writes a valid PNG."""
import struct
import subprocess
import zlib

from tests.integration.test_recovery_policy import QUICK_HEALTH
from tests.integration.test_supervisor import _finish, _start


def test_plot_of_a_run_with_a_rollback_is_a_valid_png(tmp_path, cli, quiet_env):
    run = tmp_path / "run"
    code, _, err = _finish(_start(run, overrides=QUICK_HEALTH, fake=[
        "--steps", "60", "--interval", "5", "--spike-at", "30", "--fault-generations", "1"]))
    assert code == 0, err
    out = tmp_path / "plots" / "loss.png"
    done = subprocess.run([*cli, "plot", str(run), "-o", str(out)], env=quiet_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "2 generation(s), 1 incident(s)" in done.stdout
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    # walk the chunks: every CRC right, IHDR first, IEND last, a sensible size
    pos, chunks = 8, []
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"bad CRC in {kind}"
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    width, height = struct.unpack(">II", chunks[0][1][:8])
    assert width >= 800 and height >= 500


def test_plot_of_a_run_that_never_trained_says_so(tmp_path, cli, quiet_env):
    (tmp_path / "run" / "logs").mkdir(parents=True)
    (tmp_path / "run" / "logs" / "rank-0.log").write_text("starting\n")
    done = subprocess.run([*cli, "plot", str(tmp_path / "run")], env=quiet_env, capture_output=True, text=True)
    assert done.returncode == 2 and "no step events" in done.stderr
