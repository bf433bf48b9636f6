"""Installed console scripts (fairseq-eval-lm, fairseq-generate, fairseq-hydra-train, kerple-eval-lm, ...) and
the repository's script files (``scripts/small_comparison.py``, ...) run many times without starting Python,
torch and fairseq each time (5-7 s of CPU a process on 2 cores; 3-4 s for a script file's imports). A pytest
worker starts, for a script, a process that does what the script's first lines do, importing its entry point's
module or a script file's imports (its output kept), and forks a process for each run any test asks of that script
(another where the environment has changed; at most :data:`LIVE_SERVERS` at a time). A forked run starts
its output with what the import printed, as the script's own process would, takes the run's working folder,
standard input and ``sys.argv``, calls ``sys.exit(entry_point())`` and ends as the interpreter ends a
script (an uncaught exception through ``sys.excepthook``, then the exit handlers). Nothing one run does
(the plugin imported by ``--user-dir``, logging set up, a TensorBoard writer kept open) reaches the next,
and no process has imported another script's module (fairseq's scripts and the plugin's set logging up
differently). Runs do share what the import set (the hash seed, an unseeded generator's state): where two
runs must agree independently, start one alone.

``run_forked(script, args, cwd)`` gives back the run's ``subprocess.CompletedProcess``, as
:func:`conftest.run` does, and ``run_each_forked(runs)`` one for each of several runs."""

import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

#: seconds a run may take before it is killed (its status then -9, and a line saying so on its stderr)
RUN_LIMIT = 600


def run_forked(script, args, cwd, stdin="", check=True):
    """One run of the installed console script ``script`` (or of a script file, by its path), forked from this
    worker's process that imported it (started at the first run, and again where the environment has changed
    since). Returns its ``CompletedProcess``; with ``check``, a failed run raises with its output."""
    if script.endswith(".py"):
        script = os.path.abspath(script)  # as a process's __file__ is: runs take other working folders
    with tempfile.TemporaryDirectory() as folder:
        step = {"script": script, "args": [str(a) for a in args], "cwd": str(cwd),
                **{stream: f"{folder}/{stream}" for stream in ("stdin", "stdout", "stderr")}}
        Path(step["stdin"]).write_text(stdin)
        status = _server(script).run(step)
        proc = subprocess.CompletedProcess([script, *step["args"]], status, Path(step["stdout"]).read_text(),
                                           Path(step["stderr"]).read_text())
    if check:
        _raise_if_failed(proc)
    return proc


def _raise_if_failed(proc):
    if proc.returncode != 0:
        raise AssertionError(f"{proc.args[0]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             f"{proc.stderr[-6000:]}")


def run_each_forked(runs, check=True):
    """``runs``: ``(script, arguments, working folder)`` or ``(script, arguments, working folder, standard
    input)``, each forked as :func:`run_forked` forks it, one script's runs after another (so that no more than
    one forking process is started for each). Returns a ``CompletedProcess`` for each run, in order; with
    ``check``, the first that failed raises with its output."""
    scripts = list(dict.fromkeys(script for script, *_ in runs))
    done = [None] * len(runs)
    for i in sorted(range(len(runs)), key=lambda i: scripts.index(runs[i][0])):
        script, args, cwd, *stdin = runs[i]
        done[i] = run_forked(script, args, cwd, *stdin, check=False)
    if check:
        for proc in done:
            _raise_if_failed(proc)
    return done


#: the most forking processes one pytest worker keeps at a time (each holds about 250 MB of its own)
LIVE_SERVERS = 3

#: this process's forking processes by script, the one used last at the end
_servers = {}


def _server(script):
    """``script``'s forking process, started where there is none, or where it ended or was started in another
    environment than this process's now (its ``PYTEST_CURRENT_TEST`` aside, which it is started without)."""
    environment = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    server = _servers.pop(script, None)
    if server is not None and (server.environment != environment or server.process.poll() is not None):
        server.close()
        server = None
    if server is None:
        while len(_servers) >= LIVE_SERVERS:
            _servers.pop(next(iter(_servers))).close()
        server = _Server(script, environment)
    _servers[script] = server
    return server


class _Server:
    """A process that imported ``script``'s entry point, as the script's first line does, and forks a run
    of it for each request: a step as JSON on one line of a pipe, its exit status on one line of another."""

    def __init__(self, script, environment):
        self.script, self.environment = script, environment
        self.log = tempfile.TemporaryFile("w+")  # its own output: a crash's traceback
        requests, self.requests = os.pipe()
        self.replies, replies = os.pipe()
        self.process = subprocess.Popen([sys.executable, __file__, script, str(requests), str(replies)],
                                        stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                        pass_fds=(requests, replies), env=environment, start_new_session=True)
        os.close(requests)
        os.close(replies)

    def run(self, step):
        """The run's exit status. Where this process stops waiting for it (an exception, an interrupt, no
        answer by :data:`RUN_LIMIT` and a minute), the forking process and its run are killed, so that no
        run left behind answers for the next."""
        try:
            _write_line(self.requests, json.dumps(step))
            answered, _, _ = select.select([self.replies], [], [], RUN_LIMIT + 60)
            reply = _read_line(self.replies) if answered else None
        except BaseException:
            self.close()
            raise
        if reply is None:
            self.close()
            self.log.seek(0)
            raise AssertionError(f"the process forking {self.script} ended ({self.process.returncode}) or did not "
                                 f"answer before its run ended:\n{self.log.read()[-6000:]}")
        return int(reply)

    def close(self):
        """Kill the forking process and a run it has under way (its process group), and close its pipes."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        if self.requests is not None:
            os.close(self.requests)
            os.close(self.replies)
            self.requests = self.replies = None


def _write_line(fd, text):
    data = (text + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _read_line(fd):
    """The next line from ``fd`` (its writer sends one and waits for the answer), or None at its end."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None
        data += chunk
    return data[:-1].decode()


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


def _entry_point(script):
    """The installed console script ``script``'s entry point, loaded; for the path of a script file
    (``scripts/*.py``), the file run once under another name than ``__main__`` (its imports done, its main block
    not run), and as the entry point a function that runs the file as ``__main__`` (as ``python FILE`` does)."""
    if script.endswith(".py"):
        path = list(sys.path)
        runpy.run_path(script, run_name="__imported_to_fork__")

        def run_as_main():
            sys.path[:] = path  # as the file's process starts, before its first lines add to it
            runpy.run_path(script, run_name="__main__")
            return 0
        return run_as_main
    from importlib.metadata import entry_points

    (found,) = entry_points(group="console_scripts", name=script)
    return found.load()


def _import(script):
    """``script``'s entry point (:func:`_entry_point`), and what its import wrote to file descriptors 1 and 2."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        saved = [os.dup(1), os.dup(2)]
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            entry_point = _entry_point(script)
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
            for process in _tree(pid):  # with what it started (a script file's trainings, say)
                try:
                    os.kill(process, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os.waitpid(pid, 0)
            return -signal.SIGKILL
        time.sleep(0.02)


def _tree(pid):
    """``pid`` and the processes it started, theirs, and so on (from ``/proc``), parents first."""
    tree = [pid]
    for parent in tree:
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                tree += [int(child) for child in children.read_text().split()]
            except OSError:  # ended meanwhile
                pass
    return tree


def serve(script, requests, replies):
    """Import ``script``'s entry point, then fork a run for each step read from ``requests`` and write its
    exit status to ``replies``, until ``requests`` ends."""
    # a script's first entry: its own folder (an installed console script's is the environment's bin)
    sys.path[0] = os.path.dirname(os.path.abspath(script) if script.endswith(".py") else sys.executable)
    entry_point, imported = _import(script)
    while (line := _read_line(requests)) is not None:
        step = json.loads(line)
        assert threading.active_count() == 1, f"{script}'s import started threads: forking would copy none of them"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.close(requests)  # the run has none of this process's pipes
            os.close(replies)
            _as_the_script(step, entry_point, imported)
        status = _wait(pid)
        if status == -signal.SIGKILL:
            with open(step["stderr"], "a") as err:
                err.write(f"\n[killed after {RUN_LIMIT} s]\n")
        _write_line(replies, str(status))


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
