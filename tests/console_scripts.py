"""Installed console scripts (fairseq-eval-lm, fairseq-generate, fairseq-hydra-train, kerple-eval-lm, ...)
run from one Python process that has imported torch and fairseq once: each run is a process forked
from it, which does what the script does (``sys.exit(entry_point())`` with the script's ``sys.argv``)
with its own working folder, standard input, output and error, and ends as the interpreter ends a
script (an uncaught exception through ``sys.excepthook``, then the exit handlers). Nothing a run does
(the plugin imported by ``--user-dir``, logging set up, a TensorBoard writer kept) reaches the next. A
test that runs a tool for thirty checkpoints pays Python's, torch's and fairseq's imports (about 5 s)
once rather than thirty times.

``run_in_one_process(runs)`` starts ``python console_scripts.py PLAN`` and gives back a
``subprocess.CompletedProcess`` for each run, as :func:`conftest.run` does."""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

#: what the forking process imports before its first run: what every console script here imports
PRELOADED = ("torch", "fairseq", "fairseq.options", "fairseq.checkpoint_utils", "fairseq.tasks", "fairseq.models")


def run_in_one_process(runs, check=True):
    """``runs``: ``(script, arguments, working folder)`` or ``(script, arguments, working folder, standard
    input)``. Returns a ``CompletedProcess`` for each, in order; with ``check``, the first that failed
    raises with its output."""
    with tempfile.TemporaryDirectory() as folder:
        plan = []
        for i, (script, args, cwd, *stdin) in enumerate(runs):
            Path(folder, f"{i}.stdin").write_text(stdin[0] if stdin else "")
            plan.append({"script": script, "args": [str(a) for a in args], "cwd": str(cwd),
                         **{stream: f"{folder}/{i}.{stream}" for stream in ("stdin", "stdout", "stderr", "status")}})
        Path(folder, "plan.json").write_text(json.dumps(plan))
        forks = subprocess.run([sys.executable, __file__, f"{folder}/plan.json"], capture_output=True, text=True)
        done = []
        for step in plan:
            if not Path(step["status"]).is_file():
                raise AssertionError(f"the process forking the console scripts ended ({forks.returncode}) before "
                                     f"{step['script']} {' '.join(step['args'])}:\n{forks.stdout[-3000:]}\n"
                                     f"{forks.stderr[-6000:]}")
            proc = subprocess.CompletedProcess([step["script"], *step["args"]], int(Path(step["status"]).read_text()),
                                               Path(step["stdout"]).read_text(), Path(step["stderr"]).read_text())
            if check and proc.returncode != 0:
                raise AssertionError(f"{step['script']} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                     f"{proc.stderr[-6000:]}")
            done.append(proc)
        return done


def _as_the_script(step):
    """In the forked process: ``step``'s script with its arguments, folder and files. Never returns: the
    ``SystemExit`` or uncaught exception ends this process as it ends the script's own."""
    from importlib.metadata import entry_points

    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        with open(step[name], mode) as file:
            os.dup2(file.fileno(), fd)
    os.chdir(step["cwd"])
    sys.argv = [step["script"], *step["args"]]
    (entry_point,) = entry_points(group="console_scripts", name=step["script"])
    sys.exit(entry_point.load()())


def main(plan):
    import importlib

    for module in PRELOADED:
        importlib.import_module(module)
    for step in plan:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _as_the_script(step)
        _, status = os.waitpid(pid, 0)
        Path(step["status"]).write_text(str(os.waitstatus_to_exitcode(status)))


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
