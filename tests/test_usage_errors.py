"""Command-line mistakes are one line on stderr (the usage listing is what --help is for), with
argparse's exit status 2, from the plugin's commands and from fairseq-train with the plugin loaded;
and the libraries' notices about themselves stay out of the plugin's output."""

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
        import kerple_fairseq.quiet as quiet
        quiet.silence_library_notices()
        warnings.warn("a warning of the user's own", UserWarning)
    assert [str(w.message) for w in caught] == ["a warning of the user's own"]


@pytest.mark.slow
@pytest.mark.parametrize("command", [
    [BIN / "kerple-eval-lm", "data", "--path", "x.pt", "--attn-window", "-1"],
    [BIN / "kerple-analyze", "kernels", "--max-distance", "10"],
    [BIN / "fairseq-train", "data", "--user-dir", REPO / "kerple_fairseq", "--task", "language_modeling",
     "--arch", "transformer_lm_kerple", "--bias-kernel", "bogus"],
    [BIN / "fairseq-train", "data", "--user-dir", REPO / "kerple_fairseq", "--task", "language_modeling",
     "--arch", "transformer_lm_kerple", "--kernel-parameterization", "exp"],
])
def test_installed_commands_report_usage_errors_in_one_line(command, tmp_path):
    proc = run(command, check=False, cwd=tmp_path)
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 2 and "usage:" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith(command[0].name) and ": error: " in errors[0], proc.stderr[-3000:]
    if command[0].name != "fairseq-train":  # fairseq-train logs a notice of its own before the plugin loads
        assert proc.stderr.strip() == errors[0]
