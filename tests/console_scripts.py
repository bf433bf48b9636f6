"""Installed console scripts (fairseq-eval-lm, fairseq-generate, fairseq-hydra-train, kerple-eval-lm, ...)
run many times without starting Python, torch and fairseq each time (about 5 s a process on 2 cores).
For each script, one process does what the script's first line does, importing its entry point's module
(its output kept), then forks a process for each run. That process starts its output with what the
import printed, as the script's own process would, takes the run's working folder, standard input and
``sys.argv``, calls ``sys.exit(entry_point())`` and ends as the interpreter ends a script (an uncaught
exception through ``sys.excepthook``, then the exit handlers). Nothing one run does (the plugin imported
by ``--user-dir``, logging set up, a TensorBoard writer kept open) reaches the next, and no process
has imported another script's module (fairseq's scripts and the plugin's set logging up differently).

``run_in_one_process(runs)`` gives back a ``subprocess.CompletedProcess`` for each run, as
:func:`conftest.run` does."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

#: seconds a run may take before it is killed (its status then -9, and a line saying so on its stderr)
RUN_LIMIT = 600


def run_in_one_process(runs, check=True):
    """``runs``: ``(script, arguments, working folder)`` or ``(script, arguments, working folder, standard
    input)``, each script's runs forked from one process of its own. Returns a ``CompletedProcess`` for
    each run, in order; with ``check``, the first that failed raises with its output."""
    with tempfile.TemporaryDirectory() as folder:
        plans = {}
        for i, (script, args, cwd, *stdin) in enumerate(runs):
            Path(folder, f"{i}.stdin").write_text(stdin[0] if stdin else "")
            plans.setdefault(script, []).append(
                {"script": script, "args": [str(a) for a in args], "cwd": str(cwd),
                 **{stream: f"{folder}/{i}.{stream}" for stream in ("stdin", "stdout", "stderr", "status")}})
        ended = {}
        for script, plan in plans.items():
            Path(folder, f"{script}.json").write_text(json.dumps(plan))
            ended[script] = subprocess.run([sys.executable, __file__, f"{folder}/{script}.json"], capture_output=True,
                                           text=True, timeout=RUN_LIMIT * (len(plan) + 1))
        done = []
        for i, (script, *_) in enumerate(runs):
            if not Path(folder, f"{i}.status").is_file():
                forks = ended[script]
                raise AssertionError(f"the process forking {script} ended ({forks.returncode}) before its run "
                                     f"{i}:\n{forks.stdout[-3000:]}\n{forks.stderr[-6000:]}")
            proc = subprocess.CompletedProcess([script, *map(str, runs[i][1])],
                                               int(Path(folder, f"{i}.status").read_text()),
                                               Path(folder, f"{i}.stdout").read_text(),
                                               Path(folder, f"{i}.stderr").read_text())
            if check and proc.returncode != 0:
                raise AssertionError(f"{script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
            done.append(proc)
        return done


def comparable(proc, folder):
    """``proc``'s exit status, standard output and error with ``folder`` and the log lines' times masked:
    what a run started alone and the same run forked among others must share."""
    import re

    def mask(text):
        return re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", "<time>", text.replace(str(folder), "<folder>"))

    return proc.returncode, mask(proc.stdout), mask(proc.stderr)


def _as_the_script(step, entry_point, imported):
    """In the forked process: ``step``'s run, its output begun with what the import printed. Never
    returns: the ``SystemExit`` or uncaught exception ends this process as it ends the script's own."""
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        with open(step[name], mode) as file:
            if fd:
                file.write(imported[fd])
            file.flush()
            os.dup2(file.fileno(), fd)
    os.chdir(step["cwd"])
    sys.argv = [step["script"], *step["args"]]
    sys.exit(entry_point())


def _import(script):
    """The entry point of the installed console script ``script``, imported, and what the import wrote
    to file descriptors 1 and 2."""
    from importlib.metadata import entry_points

    (found,) = entry_points(group="console_scripts", name=script)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        saved = [os.dup(1), os.dup(2)]
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            entry_point = found.load()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
        out.seek(0)
        err.seek(0)
        return entry_point, {1: out.read(), 2: err.read()}


def _wait(pid):
    """The forked run's exit status, as ``subprocess`` gives it; killed after :data:`RUN_LIMIT` seconds."""
    deadline = time.monotonic() + RUN_LIMIT
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -signal.SIGKILL
        time.sleep(0.02)


def main(plan):
    sys.path[0] = os.path.dirname(sys.executable)  # a console script's first entry: its own folder
    (script,) = {step["script"] for step in plan}
    entry_point, imported = _import(script)
    for step in plan:
        assert threading.active_count() == 1, f"{script}'s import started threads: forking would copy none of them"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _as_the_script(step, entry_point, imported)
        status = _wait(pid)
        if status == -signal.SIGKILL:
            with open(step["stderr"], "a") as err:
                err.write(f"\n[killed after {RUN_LIMIT} s]\n")
        Path(step["status"]).write_text(str(status))


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
