"""Native engine chatter (glog, UCX) is kept off the terminal: ``engine_stderr``."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from omniwire._native import engine_stderr

GLOG_LINE = (
    "E1130 23:53:36.004117 20695 transfer_metadata.cpp:1098] Local segment descriptor not found"
)


def test_engine_lines_go_to_the_log_and_other_lines_stay_on_stderr(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="omniwire.native")
    with engine_stderr("mooncake") as native:
        os.write(2, b"WARNING: Logging before InitGoogleLogging() is written to STDERR\n")
        os.write(2, f"{GLOG_LINE}\n".encode())
        os.write(2, b"[1700000000.123456] [host:12:0]  ucp_context.c:1 UCX  WARN  x\n")
        os.write(2, b"a line that is no engine's\n")
    err = capfd.readouterr().err
    assert err == "a line that is no engine's\n"
    assert len(native.lines) == 3
    assert "transfer_metadata.cpp" in native.text()
    assert [r.getMessage() for r in caplog.records][1] == f"mooncake: {GLOG_LINE}"


def test_captured_lines_survive_an_error_and_the_switch_turns_it_off(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(RuntimeError), engine_stderr("x") as native:
        os.write(2, f"{GLOG_LINE}\n".encode())
        raise RuntimeError("init failed")
    assert native.lines == [GLOG_LINE]
    assert capfd.readouterr().err == ""
    monkeypatch.setenv("OMNIWIRE_NATIVE_LOGS", "1")
    with engine_stderr("x") as native:
        os.write(2, f"{GLOG_LINE}\n".encode())
    assert native.lines == []
    assert GLOG_LINE in capfd.readouterr().err


@pytest.mark.engine
def test_a_real_mooncake_engine_start_prints_nothing() -> None:
    if importlib.util.find_spec("mooncake") is None:
        reason = "mooncake-transfer-engine is not installed"
        if os.environ.get("OMNIWIRE_REQUIRE_ENGINES") == "1":
            pytest.fail(
                reason + " (OMNIWIRE_REQUIRE_ENGINES=1: engines that run on a CPU must load)"
            )
        pytest.skip(reason)
    script = textwrap.dedent(
        """
        import os
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        import mooncake.engine
        from omniwire._native import engine_stderr
        engine = mooncake.engine.TransferEngine()
        with engine_stderr("mooncake") as native:
            rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        print(rc, len(native.lines), flush=True)
        os._exit(0)  # stopping an engine is slow; nothing to clean up here
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    rc, lines = done.stdout.split()
    assert rc == "0"
    assert "transfer_metadata.cpp" not in done.stderr, done.stderr
    assert "InitGoogleLogging" not in done.stderr, done.stderr
    assert int(lines) >= 1  # it did say something, and it went to the log


@pytest.mark.engine
def test_the_mooncake_backend_keeps_its_engine_off_the_terminal() -> None:
    """What `omniwire demo --remote` starts: the backend's own engine (not a bare
    engine_stderr block) writes no glog line to the terminal."""
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("mooncake-transfer-engine is not installed")
    script = textwrap.dedent(
        """
        import logging, os
        logging.basicConfig(level=logging.INFO, format="LOG %(name)s %(message)s",
                            handlers=[logging.StreamHandler(open(os.devnull, "w"))])
        from omniwire.backends.mooncake._engine import TransferEngine
        engine = TransferEngine("127.0.0.1", "tcp")
        print(engine.session, flush=True)
        os._exit(0)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "transfer_metadata.cpp" not in done.stderr, done.stderr
    assert "InitGoogleLogging" not in done.stderr, done.stderr
