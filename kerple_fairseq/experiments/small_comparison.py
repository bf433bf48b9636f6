"""The small offline comparison of position encodings on CPU: small models trained alike but for their
position encoding, evaluated under the early-token-cursed and last-token protocols at several lengths,
tabulated, ranked on a leaderboard over seeds, and analysed by kerple-analyze (perplexity against
length, paired intervals, kernel curves, effective lengths, position-wise perplexity,
receptive field, attention by distance). Every finished training and evaluation is recorded
(:mod:`finished_steps`), so the same command after an interruption goes on where it stopped; a run's
records, results and span losses (:mod:`~kerple_fairseq.evaluation.span_losses`) stand for it
without its checkpoint, so that a finished run can be committed and the comparison continued in
another checkout."""

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from functools import lru_cache, partial
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from kerple_fairseq.analysis import figures, leaderboard, significance, two_lengths
from kerple_fairseq.analysis.output_files import write_csv, write_text
from kerple_fairseq.errors import UsageError
from kerple_fairseq.evaluation import per_token, span_losses
from kerple_fairseq.evaluation.checkpoint_file import data_only_environment
from kerple_fairseq.experiments.comparison import (
    PROTOCOLS, CommandFailed, Comparison, Evaluated, Model, markdown_table, protocol_rows)
from kerple_fairseq.experiments.finished_steps import Step
from kerple_fairseq.experiments.language_models import model_size_flags
from kerple_fairseq.experiments.paths import BIN, SCRIPTS, USER_DIR
from kerple_fairseq.experiments.position_encodings import FAMILIES, POSITION_ENCODINGS
from kerple_fairseq.experiments.recipe import cpu_training_flags
from kerple_fairseq.experiments.run_cost import best_at_longest, estimate, model_costs, recorded_seconds, run_dirs, \
    seeds_within
from kerple_fairseq.experiments.wikitext103 import OFFICIAL_MD5, archive_tokens, preprocess, sample

DEFAULT_MODELS = ["sinusoidal", "alibi", "kerple_log"]  # names in POSITION_ENCODINGS

Run = Tuple[str, int]  # a model's name and the seed it was trained with


WITHOUT_DOWNLOAD = ("with network, run this command again; offline, pass --wikitext-dir DIR or set "
                    "WIKITEXT103_DIR=DIR, where DIR holds wiki.{train,valid,test}.tokens (an unpacked "
                    "wikitext-103-v1.zip)")


def seed_words(seeds) -> str:
    """``seed 1`` or ``seeds 1, 2, 3``."""
    return f"seed{'s' * (len(seeds) > 1)} {', '.join(map(str, seeds))}"


def downloaded_sample(url: str, download_dir: Path, md5: str = OFFICIAL_MD5,
                      log: Callable[[str], None] = print) -> Path:
    """The comparison's tokens when none are given: WikiText-103's archive from ``url``, downloaded once
    and md5-checked, unpacked in ``download_dir/wikitext-103``, and the sample cut from it in
    ``download_dir/wikitext-103-sample`` (the first 2.5 MiB of training text, the complete validation
    and test splits: the data of the documented results)."""
    full = archive_tokens(None, url, md5, download_dir, log=log, offline=WITHOUT_DOWNLOAD)
    tokens = sample(full, download_dir / "wikitext-103-sample")
    log(f"WikiText-103 is in {full}; the comparison reads its sample, {tokens}")
    return tokens


def run_dir(args: argparse.Namespace, name: str, seed: int) -> Path:
    """A training run's directory, ``<out>/<model>-seed<S>``: the same for a seed whichever others run
    beside it, so that adding seeds keeps the runs finished before."""
    return args.out / f"{name}-seed{seed}"


def run_label(args: argparse.Namespace, name: str, seed: int) -> str:
    """A training run in tables: the model's name, with the seed where there are several."""
    return name if len(args.seeds) == 1 else f"{name}-seed{seed}"


def stage(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def training_progress(line: str) -> bool:
    return "train_inner" in line or "| train |" in line or line.startswith(PROTOCOLS)


def run(cmd: list, log: Optional[Path] = None, show: Callable[[str], bool] = training_progress) -> None:
    """Run a command; the lines ``show`` picks go to the terminal, the whole output to ``log`` if given.
    On failure its last 30 lines go to stderr and :class:`CommandFailed` is raised."""
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=data_only_environment())
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if show(line):
            print("    " + line.rstrip().split(" | ", 1)[-1], flush=True)
    proc.wait()
    if log is not None:
        log.write_text("".join(lines))
    if proc.returncode != 0:
        sys.stderr.write("".join(lines[-30:]))
        raise CommandFailed(Path(str(cmd[0])).name, proc.returncode)


def trained_alike(args: argparse.Namespace, step: Step, seed: int) -> Optional[Path]:
    """The checkpoint of a finished run in ``--out`` trained with the options of ``step`` (the rotary
    model under each rotary scaling and ReRoPE, applied at evaluation), if there is one."""
    for record in sorted(args.out.glob(f"*-seed{seed}/trained.json")):
        other = Step(record, step.key, [record.parent / "checkpoint_last.pt"])
        if record != step.record and other.finished() is not None:
            return record.parent / "checkpoint_last.pt"
    return None


def training_flags(args: argparse.Namespace, name: str, seed: int, log_interval: int = 25, **task) -> List[str]:
    """fairseq-train's options of model ``name`` with ``seed``: the comparisons' model, optimiser and schedule
    (``task``: :func:`~kerple_fairseq.experiments.recipe.cpu_training_flags`'s, language modelling unless given)."""
    return [str(f) for f in [
        *POSITION_ENCODINGS[name].model_flags(), "--kernel-parameterization", args.kernel_parameterization,
        *model_size_flags(args.layers, args.width, args.heads, dropout=0.1),
        *cpu_training_flags(args.train_length, args.max_tokens, lr=0.002, warmup_updates=20, seed=seed,
                            log_format="simple", log_interval=log_interval, adam_betas="(0.9, 0.98)", clip_norm=1.0,
                            **task),
        "--max-update", args.updates]]


def training(args: argparse.Namespace, data: str, name: str, seed: int) -> Step:
    """The training of model ``name`` with ``seed`` in its run's directory on the data-bin whose
    fingerprint is ``data``: its record, key (the fairseq-train options and the data) and checkpoint."""
    save_dir = run_dir(args, name, seed)
    return Step(save_dir / "trained.json", {"fairseq-train": training_flags(args, name, seed), "data": data},
                [save_dir / "checkpoint_last.pt"])


def train(args: argparse.Namespace, data_bin: Optional[Path], step: Step, name: str, seed: int) -> Tuple[Path, float]:
    """fairseq-train of model ``name`` with ``seed`` from scratch, the :func:`training` ``step``, on
    ``data_bin`` (None: a task that draws its data); its last checkpoint and the seconds spent now. A run finished before with the same
    options is kept; one cut short is started again. A model trained as another finished run in
    ``--out`` was (same options and seed) gets a copy of that one's checkpoint."""
    save_dir, checkpoint = step.record.parent, step.outputs[0]
    flags = step.key["fairseq-train"]
    if step.finished() is not None:
        stage(f"{save_dir.name} is trained so already: keeping {checkpoint}")
        return checkpoint, 0.0
    tensorboard = args.out / "tensorboard" / save_dir.name
    for earlier in (save_dir, tensorboard):
        shutil.rmtree(earlier, ignore_errors=True)
    save_dir.mkdir(parents=True)
    started = time.time()
    same = trained_alike(args, step, seed)
    if same is not None:
        stage(f"{name} is trained as {same.parent.name} is: evaluating a copy of its checkpoint")
        shutil.copyfile(same, checkpoint)
    else:
        stage(f"training {name} ({' '.join(POSITION_ENCODINGS[name].model_flags())}), seed {seed}, {args.updates} updates")
        run([BIN / "fairseq-train", *([] if data_bin is None else [data_bin]), "--user-dir", USER_DIR, *flags, "--save-dir", save_dir,
             "--tensorboard-logdir", tensorboard], log=save_dir / "train.log")
    seconds = time.time() - started
    log = save_dir / "train.log"
    step.complete(seconds, **({"losses": last_losses(log.read_text())} if log.is_file() else {}))
    return checkpoint, seconds


#: fairseq-train's log lines of a loss (``--log-format simple``): ``| train_inner | epoch 001:  25 / 153 loss=9.87,
#: ... num_updates=25``, the epoch's ``| train | epoch 001 | loss 9.59 | ... | num_updates 153`` and ``| valid |``
LOSS_LINE = re.compile(r"\| (train_inner|train|valid) \| .*?\bloss[= ](?P<loss>[0-9.]+).*?\bnum_updates[= ](?P<updates>\d+)")


def last_losses(log: str) -> Dict[str, Dict[str, float]]:
    """The last loss fairseq-train logged (base 2, as it logs them) of each kind, ``train_inner`` (every
    ``--log-interval`` updates), ``train`` (an epoch's) and ``valid``, with the update it was logged at: kept in
    the run's record, so that the training's end stays known once its log is gone."""
    found = {}
    for match in LOSS_LINE.finditer(log):
        found[match.group(1)] = {"loss": float(match.group("loss")), "num_updates": int(match.group("updates"))}
    return found


SPAN_LOSSES = "span-losses.npz"


def keep_span_losses(run: Path) -> None:
    """The run's span losses from its per-token file: what its place on the leaderboard needs once the
    checkpoint and the per-token file are gone."""
    scored = per_token.load(str(run / "per-token.npz")).scored
    span_losses.save(str(run / SPAN_LOSSES), {key: span_losses.SpanLosses.of(s) for key, s in scored.items()})


ANALYSES = ("extrapolation", "compare", "kernels", "effective-length", "position-wise", "receptive-field", "attention")


def analyse(args: argparse.Namespace, data_bin: Path, checkpoints: Dict[Run, Path]) -> Path:
    """kerple-analyze's figures and numbers in ``<out>/analysis``, those of ``args.analyses``:
    perplexity against length and the paired comparison from the evaluation's files of every run (a
    model's seeds under its name), then the five model analyses of each model's first seed."""
    out = args.out / "analysis"
    label = {name: POSITION_ENCODINGS[name].label for name, _ in checkpoints}  # as in the tables
    # the seeds every model has (all of them, unless --budget-hours left some models fewer)
    common = set.intersection(*({seed for n, seed in checkpoints if n == name} for name, _ in checkpoints))
    checkpoints = {(name, seed): c for (name, seed), c in checkpoints.items() if seed in common}
    every_run = ["--labels", *(label[name] for name, _ in checkpoints), "--out", out]
    first = {name: c for (name, seed), c in checkpoints.items() if seed == min(common)}
    paths = ["--path", *first.values(), "--labels", *(label[name] for name in first), "--out", out]
    on_data = [data_bin, "--length", max(args.eval_lengths), "--cpu", "--no-progress-bar", "--max-tokens", "16384"]
    analyses = [
        ["extrapolation", "--path", *(c.parent / "eval.json" for c in checkpoints.values()), *every_run],
        ["compare", "--path", *(c.parent / "per-token.npz" for c in checkpoints.values()), *every_run],
        ["kernels", *paths, "--max-distance", max(args.eval_lengths), "--data", data_bin],
        ["effective-length", *paths, "--data", data_bin],
        ["position-wise", *on_data, *paths, "--windowed-reference"],
        ["receptive-field", *on_data, *paths, "--num-segments", args.num_segments],
        ["attention", *on_data, *paths],
    ]
    for analysis in (a for a in analyses if a[0] in args.analyses):
        inputs = [a for a in analysis if isinstance(a, Path) and a.suffix in (".pt", ".npz")]
        missing = [path for path in inputs if not path.exists()]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise UsageError(f"kerple-analyze {analysis[0]} reads {missing[0]}{more}, absent: a run kept without its "
                             f"checkpoint and per-token file lacks them; leave {analysis[0]} out of --analyses, or "
                             "remove that run's trained.json to train it again")
        stage(f"kerple-analyze {analysis[0]}")
        run([sys.executable, SCRIPTS / "analyze.py", *analysis],
            show=lambda line: line.startswith((*first, "kerple-analyze", *PROTOCOLS, " ")))
    return out


def table(results: Dict[str, List[dict]], lengths) -> str:
    """A row per run and protocol of its perplexity at each length."""
    rows = [row for name, records in results.items() for row in protocol_rows([name], records)]
    return markdown_table(["model", "protocol"], rows, lengths)


def duration(seconds: float) -> str:
    minutes = round(seconds / 60)
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min"


def board_of(runs: Dict[Run, Path], records: Dict[Run, List[dict]], train_length: int,
             bootstrap_seed: int = 1) -> Tuple[leaderboard.Leaderboard, leaderboard.Scores]:
    """The leaderboard of a comparison's evaluated ``runs`` (their directories, each with its span losses),
    from their kerple-eval-lm ``records``, each model against ALiBi and its family's baseline; and the
    runs' span losses by model and seed."""
    by_model: Dict[str, Dict[int, List[dict]]] = {}
    for (name, seed), r in records.items():
        by_model.setdefault(name, {})[seed] = r
    entrants = [leaderboard.Entrant(name, POSITION_ENCODINGS[name].label, POSITION_ENCODINGS[name].family,
                                    ["alibi", POSITION_ENCODINGS[name].baseline], by_seed)
                for name, by_seed in by_model.items()]

    @lru_cache(maxsize=None)  # the references' files are read again for every model
    def scores(name: str, seed: int):
        return span_losses.load(str(runs[name, seed] / SPAN_LOSSES))

    return leaderboard.build(entrants, train_length, scores, bootstrap_seed=bootstrap_seed), scores


def write_leaderboard(args: argparse.Namespace,
                      evaluated: Dict[Run, Evaluated]) -> Tuple[leaderboard.Leaderboard, leaderboard.Scores, str]:
    """The leaderboard of the ``evaluated`` runs in ``<out>/leaderboard.{md,csv,png}``: the board, the
    runs' span losses and its markdown."""
    board, scores = board_of({run: run_dir(args, *run) for run in evaluated}, {run: e.records for run, e in evaluated.items()},
                     args.train_length)
    entrants = board.entrants
    seconds = sum(sum(recorded_seconds(run_dir(args, *run))) for run in evaluated)
    short, long_ = board.train_length, board.longest
    fewer = [e.label for e in entrants if len(e.records) < len(board.seeds)]
    text = [f"# Leaderboard: {len(entrants)} position encodings, {seed_words(board.seeds)}",
            "",
            f"Validation perplexity, mean ± sample standard deviation over the seeds, trained at L={short} "
            f"for {args.updates} updates of {args.max_tokens} tokens; {args.layers} layers, width {args.width}, "
            f"{args.heads} heads, {args.vocab_size or 'full'} vocabulary. Ranked by the mean at L={long_}. "
            f"A difference (model − reference, seed by seed, each with its {100 * board.confidence:g}% interval: at "
            f"each end the more conservative of a paired bootstrap's, over {significance.BOARD_SAMPLES:,} resamples of "
            "the scored blocks or "
            "targets and moved inward by its Monte-Carlo error, and a t-interval over them) is resolved when every "
            "seed has the same sign and an interval excluding zero; no verdict depends on the bootstrap's seed. "
            f"Training and evaluation took {duration(seconds)} in all on this machine "
            "(the sum of the recorded steps)."
            + (f" Trained with fewer seeds (--budget-hours): {', '.join(fewer)}; each is compared over the seeds "
               "it shares with its reference." if fewer else "")]
    for protocol in board.protocols:
        text += ["", f"## {protocol}", "", leaderboard.markdown(board, protocol)]
    for protocol in board.protocols:
        text += ["", f"## {protocol} at L={long_}, seed by seed", "", leaderboard.seed_markdown(board, protocol, long_)]
    text += ["", "## Every length", "", leaderboard.lengths_markdown(board)]
    markdown = "\n".join(text) + "\n"
    write_text(str(args.out / "leaderboard.md"), markdown)
    header, rows = leaderboard.csv_rows(board)
    write_csv(str(args.out / "leaderboard.csv"), header, rows)
    curves = [(e.label, e.family, protocol, board.lengths, [board.mean(e.name, protocol, n) for n in board.lengths],
               [min(board.ppl[e.name, protocol, n]) for n in board.lengths],
               [max(board.ppl[e.name, protocol, n]) for n in board.lengths])
              for e in entrants for protocol in board.protocols]
    families = [f for f in FAMILIES if any(e.family == f for e in entrants)]
    (args.out / "leaderboard.png").unlink(missing_ok=True)  # no figure rather than one of another run
    try:
        figures.leaderboard(curves, families, board.protocols, short, POSITION_ENCODINGS["alibi"].label,
                            str(args.out / "leaderboard.png"))
    except figures.PlotsUnavailable as e:
        stage(str(e))
    return board, scores, markdown


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"


def planned_runs(args: argparse.Namespace, runs: List[Run]) -> List[Run]:
    """The ``runs`` to make, in order, once the first is made: their cost estimated from it (and from the
    models' relative costs in ``--other-length``'s records) and said; over ``--budget-hours``, the seeds
    that fit (:func:`~kerple_fairseq.experiments.run_cost.seeds_within`), said too."""
    first = runs[0]
    measured = recorded_seconds(run_dir(args, *first))
    finished = [r for r in runs if recorded_seconds(run_dir(args, *r)) is not None]
    relative = model_costs(args.other_length) if args.other_length else {}
    here = {name: seconds for name, seconds in model_costs(args.out).items() if name in args.models}
    cost = estimate(runs, first[0], here, relative)
    left = sum(cost[r] for r in runs if r not in finished)
    basis = (f"each model's cost relative to {first[0]}'s in {args.other_length}" if first[0] in relative
             else f"each model costing what {first[0]} did")
    stage(f"cost: {run_label(args, *first)} took {measured[0]:.0f} s to train and {measured[1]:.0f} s to evaluate; "
          f"{len(finished)} of {len(runs)} runs are finished, the other {len(runs) - len(finished)} need about "
          f"{hours(left)} on this machine ({basis}, or the model's own runs here where it has some)")
    ranked = [name for name in best_at_longest(args.other_length) if name in args.models] if args.other_length else []
    in_question = {*args.every_seed_for, *ranked[:args.every_seed_top]}
    in_question |= {r for name in in_question for r in ("alibi", POSITION_ENCODINGS[name].baseline) if r in args.models}
    budget = None if args.budget_hours is None else args.budget_hours * 3600
    seeds = seeds_within(budget, args.models, args.seeds, in_question, cost, finished)
    chosen = [r for r in runs if r[1] in seeds[r[0]]]
    if len(chosen) < len(runs):
        fewer = [name for name in args.models if len(seeds[name]) < len(args.seeds)]
        stage(f"over --budget-hours {args.budget_hours:g}: every seed of {', '.join(sorted(in_question))} (the top "
              f"{args.every_seed_top} of {args.other_length or 'no other comparison'}, --every-seed-for, and what they "
              f"are compared with), seed {args.seeds[0]} of the other {len(fewer)} models: about "
              f"{hours(sum(cost[r] for r in chosen if r not in finished))} for the {len(chosen) - len(finished)} runs "
              "left; the same command with a larger --budget-hours, or none, adds the other seeds")
    return chosen


def evaluated_in(directory: Path, models: Sequence[str]) -> Tuple[Dict[Run, Path], Dict[Run, List[dict]], set]:
    """The evaluated runs of ``models`` in a comparison's ``directory`` (those with span losses and kerple-eval-lm
    records): their directories, records, and the training lengths they name."""
    runs = {run: path for run, path in run_dirs(directory).items()
            if run[0] in models and (path / SPAN_LOSSES).is_file() and (path / "eval.json").is_file()}
    records = {run: json.loads((path / "eval.json").read_text()) for run, path in runs.items()}
    return runs, records, {r.get("train_length") for rs in records.values() for r in rs}


def other_length(args: argparse.Namespace) -> Tuple[Dict[Run, Path], Dict[Run, List[dict]], int]:
    """``--other-length``'s evaluated runs of these models (their directories and kerple-eval-lm records)
    and the length they were trained at; a :class:`UsageError` where it holds none, or several lengths, or
    this comparison's."""
    try:
        runs, records, lengths = evaluated_in(args.other_length, args.models)
    except (ValueError, TypeError, AttributeError) as e:
        raise UsageError(f"--other-length {args.other_length} holds an unreadable eval.json ({e}): give the --out of a "
                         "comparison at another training length") from None
    if len(lengths) != 1 or None in lengths or args.train_length in lengths:
        held = f"training lengths {', '.join(sorted(map(str, lengths)))}" if records else "no evaluated run of them"
        raise UsageError(f"--other-length {args.other_length} must hold evaluated runs of these models trained at one "
                         f"length other than {args.train_length}; it holds {held}")
    return runs, records, lengths.pop()


def write_both_lengths(args: argparse.Namespace, board: leaderboard.Leaderboard, scores: leaderboard.Scores) -> str:
    """This comparison and ``--other-length``'s seen together (:mod:`~kerple_fairseq.analysis.two_lengths`)
    over the models both hold, in ``<out>/both-lengths.{md,csv,png}`` and ``both-lengths-swaps.csv``; its markdown."""
    other, other_scores = board_of(*other_length(args))
    view = two_lengths.build(other, board, other_scores, scores)
    where = {other.train_length: args.other_length, board.train_length: args.out}
    text = [f"# Two training lengths: {len(view.models)} position encodings",
            "",
            "Validation perplexity of the same models trained alike but for the training length: "
            + "; ".join(f"L_train={b.train_length} in {where[b.train_length]}, {seed_words(b.seeds)}"
                        for b in view.boards)
            + ". Ranks are among these models, by the mean over each model's seeds at the longest length evaluated "
            "after each training; the change is from the training length to there. "
            "A pair swaps when its order at the longest length differs between the training lengths; each "
            "length's paired comparison of the pair (the leaderboard's intervals; the model behind at the shorter "
            "length minus the one ahead, seed by seed over the seeds both have) resolves its order there or not."]
    for protocol in view.protocols:
        found = two_lengths.counts(view, protocol)
        text += ["", f"## {protocol}", "",
                 f"Pairs that swap: {sum(found.values())}" + ("".join(f"; {finding}: {n}" for finding, n in sorted(
                     found.items()))) + ".", "", two_lengths.markdown(view, protocol)]
    markdown = "\n".join(text) + "\n"
    write_text(str(args.out / "both-lengths.md"), markdown)
    write_csv(str(args.out / "both-lengths.csv"), *two_lengths.csv_rows(view))
    write_csv(str(args.out / "both-lengths-swaps.csv"), *two_lengths.swap_csv_rows(view))
    (args.out / "both-lengths.png").unlink(missing_ok=True)
    try:
        figures.ranks_at_two_lengths({p: two_lengths.figure_lines(view, p) for p in view.protocols},
                                     [(b.train_length, b.longest) for b in view.boards], FAMILIES,
                                     str(args.out / "both-lengths.png"))
    except figures.PlotsUnavailable as e:
        stage(str(e))
    return markdown


def compare(args: argparse.Namespace, tokens_dir: Path, data_bin: Path) -> None:
    """The whole comparison with ``scripts/small_comparison.py``'s options ``args``: ``tokens_dir``
    preprocessed into ``data_bin``, then results, table and figures in ``args.out``. Raises
    :class:`~kerple_fairseq.experiments.wikitext103.PrepareError` or :class:`CommandFailed`."""
    started = time.time()
    if args.other_length:
        other_length(args)  # refused now rather than after the runs
    preprocess(tokens_dir, data_bin, args.vocab_size, log=stage)
    comparison = Comparison(
        data_bin, args.eval_lengths, args.num_targets, ["--cpu", "--no-progress-bar"], run,
        announce=lambda model: stage(
            f"evaluating {run_label(args, *model.key)} at lengths {', '.join(map(str, args.eval_lengths))}: early-token-cursed "
            f"(every token, non-overlapping blocks) and last-token ({args.num_targets} targets)"),
        log=stage, kept=(SPAN_LOSSES,), keep=keep_span_losses)
    steps = {(name, seed): training(args, comparison.data_fingerprint, name, seed)
             for seed in args.seeds for name in args.models}  # every model's first seed before any second
    models = {(name, seed): Model((name, seed), partial(train, args, data_bin, step, name, seed),
                                  eval_flags=[*POSITION_ENCODINGS[name].eval_flags,
                                              "--position-wise", run_dir(args, name, seed) / "position-wise.csv",
                                              "--per-token", run_dir(args, name, seed) / "per-token.npz"], training=step)
              for (name, seed), step in steps.items()}
    evaluated = comparison.train_and_evaluate(
        models.values(), plan=lambda every: [models[run] for run in planned_runs(args, [m.key for m in every])])
    results = {run_label(args, *key): e.records for key, e in evaluated.items()}
    text = (f"Validation perplexity (early-token-cursed: every token, non-overlapping blocks; last-token: "
            f"the same {args.num_targets} targets after L-1 tokens), trained at L={args.train_length} "
            f"for {args.updates} updates of {args.max_tokens} tokens; {args.layers} layers, width {args.width}, "
            f"{args.heads} heads, {args.vocab_size or 'full'} vocabulary, {seed_words(args.seeds)}, "
            f"--kernel-parameterization {args.kernel_parameterization}.\n\n"
            + table(results, args.eval_lengths))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.md").write_text(text + "\n")
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print("\n" + text + "\n")
    stage(f"the leaderboard: {args.out / 'leaderboard.md'} (.csv, .png)")
    board, scores, markdown = write_leaderboard(args, evaluated)
    print(markdown)
    if args.other_length:
        stage(f"both training lengths: {args.out / 'both-lengths.md'} (.csv, -swaps.csv, .png)")
        print(write_both_lengths(args, board, scores))
    figures_dir = analyse(args, data_bin, {key: e.checkpoint for key, e in evaluated.items()})
    if args.analyses:
        stage(f"figures and their numbers in {figures_dir}: {', '.join(args.analyses)} (.png with the plots extra, "
              ".csv, .json)")
    stage(f"done in {(time.time() - started) / 60:.1f} min; results in {args.out}")
