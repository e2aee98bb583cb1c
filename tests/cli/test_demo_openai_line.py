"""The demo's printed lines work as printed: the OpenAI SDK one-liner, run by a shell, gets a reply."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from clikit import clean_env, running


def test_the_printed_openai_line_runs_as_printed() -> None:
    with running("demo", "--host", "127.0.0.1", "--port", "0", "--count", "2") as demo:
        demo.wait_for(r"^OpenAI SDK:")
        line = demo.wait_for(r"^  (python -c .*)$").group(1)
        demo.wait_for(r"Ctrl-C to stop")
        assert shlex.split(line)[0] == "python" and "api_key=" in line and "import" in line
        # As a user with the virtualenv active runs it: `python` is this interpreter, found on PATH.
        bin_dir = str(Path(sys.executable).parent)
        env = clean_env(PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
        done = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip(), "the reply's text is printed"
        assert demo.interrupt() in (0, 130)
