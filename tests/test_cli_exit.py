"""``tpu-train`` ends its process without the interpreter's object-by-object teardown, after
doing what an exit must: thread pools stopped and joined, atexit handlers run, output flushed;
a program that calls ``cli.main()`` itself (a test, a notebook) keeps running."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tpu_train import cli

ENDING = textwrap.dedent("""
    import atexit, sys, time
    from concurrent.futures import ThreadPoolExecutor
    from tpu_train import cli

    pool = ThreadPoolExecutor(1)          # its worker is no daemon: stopped at exit
    pool.submit(time.sleep, 0.5)
    atexit.register(lambda: print("atexit handler ran", flush=True))
    sys.stdout.write("unflushed output")  # flushed by the ending
    cli._end_process_now()
    print("not reached")
""")


def test_the_ending_stops_pools_runs_atexit_and_flushes():
    done = subprocess.run([sys.executable, "-c", ENDING], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "unflushed outputatexit handler ran\n", done.stdout
    assert "not reached" not in done.stdout


def test_only_the_command_process_ends_itself(monkeypatch):
    for argv, command in ((["python", "-m", "tpu_train.cli", "trainer.max_steps=1"], True),
                          (["/venv/bin/python", "/venv/bin/tpu-train"], True),
                          (["python", "-m", "pytest", "tests"], False),
                          (["python", "my_notebook_script.py", "-m", "x"], False)):
        monkeypatch.setattr(sys, "orig_argv", argv)
        assert cli._is_the_process_command() is command, argv
