"""Installed console scripts (fairseq-eval-lm, fairseq-generate, fairseq-hydra-train, kerple-eval-lm, ...)
run from one Python process that has imported the scripts' modules once (what each script imports
first: torch and fairseq with them, as the script imports them): each run is a process forked from it, which does what the script does (``sys.exit(entry_point())`` with the script's ``sys.argv``)
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

def run_in_one_process(runs, check=True):
    """``runs``: ``(script, arguments, working folder)`` or ``(script, arguments, working folder, standard
    input)``, of scripts of one package (fairseq's, or the plugin's: the plugin imports fairseq otherwise
    than fairseq's scripts do, so a process that has imported one is not the start of the other). Returns a ``CompletedProcess`` for each, in order; with ``check``, the first that failed
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


def _entry_point(script):
    from importlib.metadata import entry_points

    (found,) = entry_points(group="console_scripts", name=script)
    return found


def _as_the_script(step, entry_point):
    """In the forked process: ``step``'s script with its arguments, folder and files. Never returns: the
    ``SystemExit`` or uncaught exception ends this process as it ends the script's own."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        with open(step[name], mode) as file:
            os.dup2(file.fileno(), fd)
    os.chdir(step["cwd"])
    sys.argv = [step["script"], *step["args"]]
    sys.exit(entry_point())


def main(plan):
    entry_points = {step["script"]: _entry_point(step["script"]) for step in plan}
    packages = {found.module.split(".")[0] for found in entry_points.values()}
    assert len(packages) == 1, f"scripts of one package in one plan, not of {sorted(packages)}"
    loaded = {script: found.load() for script, found in entry_points.items()}  # imports their modules
    for step in plan:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _as_the_script(step, loaded[step["script"]])
        _, status = os.waitpid(pid, 0)
        Path(step["status"]).write_text(str(os.waitstatus_to_exitcode(status)))


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
