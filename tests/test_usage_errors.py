"""Command-line mistakes of the plugin's commands are one line on stderr (the usage listing is what
--help is for), with argparse's exit status 2 (fairseq-train's: tests/test_command_line.py); the
libraries' notices about themselves stay out of the plugin's output; the entry scripts set up
./.venv on their first run."""

import shutil
import subprocess
import sys
import warnings

import pytest

from conftest import BIN, REPO, run
from kerple_fairseq.analysis.cli import build_parser as analyze_parser
from kerple_fairseq.evaluation.cli import build_parser as eval_lm_parser


@pytest.mark.parametrize("parser, argv, expected", [
    (eval_lm_parser, ["data", "--protocol", "bogus"], "argument --protocol: invalid choice: 'bogus'"),
    (eval_lm_parser, ["data", "--lengths", "0"], "argument --lengths: must be a positive integer"),
    (analyze_parser, ["nothing"], "invalid choice: 'nothing'"),
    (analyze_parser, ["kernels"], "the following arguments are required: --path"),
    (analyze_parser, ["compare", "--path", "a.npz", "--samples", "x"], "argument --samples: invalid"),
])
def test_parse_errors_are_one_line(parser, argv, expected, capsys):
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert len(err.strip().splitlines()) == 1 and expected in err and "usage:" not in err, err
    assert err.rstrip().endswith("--help)")  # where the options are listed


def test_importing_the_plugin_leaves_logging_and_warnings_quiet():
    """In a fresh interpreter: no fairseq INFO or DEBUG lines, no deprecation warnings, and the root
    logger still unconfigured, so a later logging.basicConfig takes effect."""
    code = ("import logging, warnings; warnings.simplefilter('default'); import kerple_fairseq; "
            "import fairseq.dataclass.utils as u, fairseq.options as o; "
            "u.convert_namespace_to_omegaconf(o.parse_args_and_arch(o.get_eval_lm_parser(), ['d'])); "
            "assert not logging.getLogger().handlers; logging.basicConfig(level=logging.INFO); "
            "assert logging.getLogger().level == logging.INFO")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]


def test_other_warnings_still_show():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        import kerple_core.quiet as quiet
        quiet.silence_library_notices()
        warnings.warn("a warning of the user's own", UserWarning)
    assert [str(w.message) for w in caught] == ["a warning of the user's own"]


@pytest.mark.slow
@pytest.mark.parametrize("command", [
    [BIN / "kerple-eval-lm", "data", "--path", "x.pt", "--attn-window", "-1"],
    [BIN / "kerple-analyze", "kernels", "--max-distance", "10"],
])
def test_installed_commands_report_usage_errors_in_one_line(command, tmp_path):
    proc = run(command, check=False, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(command[0].name) and ": error: " in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["prepare-wikitext-103.sh", "train-wikitext-103.sh", "reproduce-wikitext-103.sh"])
def test_entry_scripts_set_up_the_environment_on_a_fresh_checkout(script, tmp_path):
    """In a checkout without ./.venv the script runs setup-env.sh first (here a stand-in whose
    ./.venv/bin/python runs this interpreter), then itself; once ./.venv has fairseq, it does not run it again."""
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO / "scripts", checkout / "scripts")
    (checkout / "scripts" / "setup-env.sh").write_text(
        'cd "$(dirname "$0")/.." && echo ran >> setup-env.calls && mkdir -p .venv/bin && '
        f"printf '#!/bin/sh\\nexec {sys.executable} \"$@\"\\n' > .venv/bin/python && chmod +x .venv/bin/python\n")
    for _ in range(2):
        proc = run(["bash", checkout / "scripts" / script, "--help"], cwd=tmp_path)
        assert proc.stdout.startswith("usage:") and "Traceback" not in proc.stderr
    assert (checkout / "setup-env.calls").read_text() == "ran\n"
