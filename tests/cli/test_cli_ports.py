"""A taken port is one line and exit 2, said before anything else is printed, with a free port to try."""

from __future__ import annotations

import re
import socket

import pytest

from clikit import busy_port, run_cli


@pytest.mark.parametrize(
    ("args", "prog"),
    [
        pytest.param(["demo", "--host", "127.0.0.1"], "prefix-router demo", id="demo"),
        pytest.param(
            ["serve", "--host", "127.0.0.1", "--backend", "http://127.0.0.1:9"], "prefix-router", id="serve"
        ),
    ],
)
def test_a_busy_router_port_is_one_line_before_any_banner(args: list[str], prog: str) -> None:
    with busy_port() as port:
        done = run_cli(*args, "--port", str(port))
    assert done.returncode == 2
    assert done.stdout == ""  # no banner, no curl line that would reach whatever holds the port
    (line,) = done.stderr.splitlines()
    match = re.fullmatch(rf"{prog}: port {port} is in use; try --port (\d+)", line)
    assert match, line
    suggested = int(match.group(1))
    assert suggested > port
    with socket.socket() as sock:  # the suggestion was free when it was made (and almost surely still is)
        sock.bind(("127.0.0.1", suggested))


def test_a_busy_sim_port_is_one_line_before_any_url() -> None:
    with busy_port() as port:
        done = run_cli("sim", "--port", str(port - 1), "--count", "2")
    assert done.returncode == 2
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("prefix-router sim: ") and f"{port - 1}..{port}" in line and "--port" in line
