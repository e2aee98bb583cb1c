"""The kit the tests and benchmarks share stops what it starts, and says why when a child fails."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from loopback import eventually, wait_until
from processes import ExitedEarly, launch_router, start_process, stop_process

# A child that leaves a grandchild deaf to SIGTERM in its process group; deaf itself if asked.
FAMILY = """
import signal, subprocess, sys, time
if sys.argv[1] == "deaf":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
child = subprocess.Popen([sys.executable, "-c", code])
print(child.pid, flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    """Not running: no such process, or a zombie waiting for a parent that is not ours to be."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


@pytest.mark.parametrize(
    ("leader", "ends_by"), [("deaf", -signal.SIGKILL), ("hears", -signal.SIGTERM)], ids=["deaf", "hears"]
)
def test_stop_process_ends_the_child_and_what_it_left_in_its_group(
    tmp_path: Path, leader: str, ends_by: int
) -> None:
    log = tmp_path / "family.log"
    proc = start_process([sys.executable, "-c", FAMILY, leader], log)
    wait_until(lambda: log.read_text().strip() != "", 10, "the grandchild's pid")
    grandchild = int(log.read_text().split()[0])
    stop_process(proc, timeout_s=0.5, linger_s=0.5)
    assert proc.returncode == ends_by
    wait_until(lambda: gone(grandchild), 5, "the grandchild's end")


def test_a_router_that_refuses_its_config_raises_with_its_log(tmp_path: Path) -> None:
    router = launch_router([], tmp_path / "router.log")  # no backends: refused, exit 2
    try:
        with pytest.raises(ExitedEarly, match="exited with 2") as info:
            router.wait_ready(timeout_s=30)
        assert "config error" in info.value.log
    finally:
        router.stop()


async def test_eventually_names_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match="the answer not reached"):
        await eventually(lambda: False, 0.05, "the answer")

    async def ready() -> bool:
        return True

    await eventually(ready, 0.05)


def test_clean_env_leaves_no_router_setting_whatever_its_case(monkeypatch: pytest.MonkeyPatch) -> None:
    from processes import clean_env

    monkeypatch.setenv("PREFIX_ROUTER_SERVER__PORT", "1")
    monkeypatch.setenv("prefix_router_server__host", "x")
    env = clean_env(PREFIX_ROUTER_KEEP="yes")
    assert {k for k in env if k.upper().startswith("PREFIX_ROUTER_")} == {"PREFIX_ROUTER_KEEP"}
    assert env["PATH"] == os.environ["PATH"]
