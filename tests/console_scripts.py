"""Installed console scripts (fairseq-eval-lm, fairseq-generate, fairseq-hydra-train, ...) run one after
another in one new Python process, each through the entry point its script calls, with its own
``sys.argv``, working folder, standard output and standard error. A test that runs a tool for each of
thirty checkpoints pays Python's, torch's and fairseq's start once rather than thirty times.

``run_in_one_process(runs)`` starts ``python console_scripts.py PLAN``; each run gives back a
``subprocess.CompletedProcess`` as :func:`conftest.run` does."""

import json
import os
import subprocess
import sys
import tempfile
import traceback
from importlib.metadata import entry_points
from pathlib import Path


def run_in_one_process(runs, check=True):
    """``runs``: ``(script, arguments, working folder)`` triples. Returns a ``CompletedProcess`` for
    each, in order; with ``check``, the first that failed raises with its output."""
    with tempfile.TemporaryDirectory() as folder:
        plan = [{"script": script, "args": [str(a) for a in args], "cwd": str(cwd),
                 "stdout": f"{folder}/{i}.out", "stderr": f"{folder}/{i}.err", "status": f"{folder}/{i}.status"}
                for i, (script, args, cwd) in enumerate(runs)]
        Path(folder, "plan.json").write_text(json.dumps(plan))
        driver = subprocess.run([sys.executable, __file__, f"{folder}/plan.json"], capture_output=True, text=True)
        done = []
        for (script, args, _), step in zip(runs, plan):
            if not Path(step["status"]).is_file():
                raise AssertionError(f"the process running the console scripts ended ({driver.returncode}) before "
                                     f"{script} {' '.join(step['args'])}:\n{driver.stdout[-3000:]}\n{driver.stderr[-6000:]}")
            proc = subprocess.CompletedProcess([script, *step["args"]], int(Path(step["status"]).read_text()),
                                               Path(step["stdout"]).read_text(), Path(step["stderr"]).read_text())
            if check and proc.returncode != 0:
                raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
            done.append(proc)
        return done


def _entry_point(script):
    """The function the installed console script ``script`` calls."""
    (found,) = entry_points(group="console_scripts", name=script)
    return found.load()


def _status(main):
    """What the console script's ``sys.exit(main())`` exits with."""
    try:
        code = main()
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # noqa: BLE001: as the interpreter would, print it and exit 1
        traceback.print_exc()
        return 1
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _as_at_exit():
    """What a tool leaves to its process's exit, done before the next run: fairseq's TensorBoard
    writers, kept by key across runs with paths relative to the run's working folder, closed and
    forgotten."""
    progress_bar = sys.modules.get("fairseq.logging.progress_bar")
    if progress_bar is not None:
        for writer in getattr(progress_bar, "_tensorboard_writers", {}).values():
            writer.close()
        getattr(progress_bar, "_tensorboard_writers", {}).clear()


def _run(step):
    """One run of ``step``'s script, its output written at the file-descriptor level (where logging's
    handlers, made when a tool's module was first imported, also write) into its files."""
    saved = [os.dup(1), os.dup(2)]
    cwd = os.getcwd()
    try:
        with open(step["stdout"], "w") as out, open(step["stderr"], "w") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            os.chdir(step["cwd"])
            sys.argv = [step["script"], *step["args"]]
            status = _status(_entry_point(step["script"]))
            _as_at_exit()
            sys.stdout.flush()
            sys.stderr.flush()
    finally:
        os.chdir(cwd)
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
    Path(step["status"]).write_text(str(status))


if __name__ == "__main__":
    for step in json.loads(Path(sys.argv[1]).read_text()):
        _run(step)
