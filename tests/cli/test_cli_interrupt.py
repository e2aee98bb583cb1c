"""Ctrl-C anywhere ends with one line on stderr and exit 0 (a drained server) or 130, never a traceback."""

from __future__ import annotations

import pytest

from clikit import running

LOAD = ["demo", "--load", "--count", "2", "--groups", "8", "--prompts", "40", "--concurrency", "2"]

CASES = [
    # (command, a line that shows it is past start-up, what the last stderr line says, exit codes allowed)
    pytest.param(
        ["serve", "--host", "127.0.0.1", "--port", "0", "--backend", "http://127.0.0.1:9"],
        r"listening on",
        "prefix-router: stopped",
        {0},
        id="serve",
    ),
    pytest.param(
        ["demo", "--port", "0", "--count", "2"],
        r"Ctrl-C to stop",
        "prefix-router demo: stopped",
        {0},
        id="demo",
    ),
    pytest.param(LOAD, r"\[prefix\] \d+/", "prefix-router: stopped", {130}, id="demo-load"),
    pytest.param(
        ["sim", "--port", "0", "--count", "2"], r"^http://", "prefix-router sim: stopped", {0}, id="sim"
    ),
]


@pytest.mark.parametrize(("args", "ready", "last", "codes"), CASES)
def test_ctrl_c_ends_with_one_line_and_no_traceback(
    args: list[str], ready: str, last: str | tuple[str, ...], codes: set[int]
) -> None:
    with running(*args) as command:
        command.wait_for(ready)
        code = command.interrupt()
    assert code in codes, (code, command.stderr)
    assert not [line for line in command.stderr if "Traceback" in line or "Error" in line], command.stderr
    assert command.stderr and command.stderr[-1] in (last if isinstance(last, tuple) else (last,))


def test_ctrl_c_during_the_load_run_prints_nothing_but_that_line() -> None:
    """The case that printed ~55 lines of chained tracebacks: a load run cancelled mid-request."""
    with running(*LOAD) as command:
        command.wait_for(r"\[prefix\] \d+/")
        assert command.interrupt() == 130
    assert command.stderr == ["prefix-router: stopped"]
