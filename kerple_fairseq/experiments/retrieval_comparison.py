"""The retrieval comparison on CPU: the perplexity board's position encodings, trained alike on the retrieval
tasks (:mod:`kerple_fairseq.tasks.retrieval`) at one length, their answers' accuracy measured from 1x to 32x
that length by ``kerple-eval-lm --task retrieval``, again on examples whose needles go through fixed depth
bands, and the retrieval board (:mod:`~kerple_fairseq.analysis.retrieval_board`) and its depth map written in
``--out``. Every training and evaluation is
recorded (:mod:`finished_steps`): the same command after an interruption goes on where it stopped, and a run
kept with its records, results and example scores stands for itself without its checkpoint."""

import argparse
import csv
import json
import os
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from kerple_fairseq.analysis import figures, retrieval_board, significance
from kerple_fairseq.analysis.output_files import write_csv, write_text
from kerple_fairseq.evaluation import retrieval_accuracy
from kerple_fairseq.errors import UsageError
from kerple_fairseq.experiments.comparison import EVALUATION_RECORD
from kerple_fairseq.experiments.finished_steps import Step, file_digest
from kerple_fairseq.experiments.paths import SCRIPTS
from kerple_fairseq.experiments.position_encodings import FAMILIES, POSITION_ENCODINGS
from kerple_fairseq.experiments.run_cost import FURTHER_EVALUATION, Run, estimate, measured_model, model_costs, recorded_seconds
from kerple_fairseq.experiments.retrieval_training import train_to_criterion
from kerple_fairseq.experiments.small_comparison import duration, hours, run, run_dir, seed_words, stage, training_flags
from kerple_fairseq.tasks.retrieval_sequences import COPY_SPAN, TASKS, Settings

RESULTS, SCORES = "eval.json", "example-scores.npz"  # beside each run's records: what stands for it without its checkpoint
BOARD, DEPTH_MAP = "retrieval-board", "retrieval-depth-map"
#: the depth map's results and record beside each run's; its tasks, those with a needle (copying's source is
#: always half the example back)
MAP_RESULTS, MAP_RECORD, MAP_TASKS = "depth-map.json", FURTHER_EVALUATION, ("mqar", "passkey")


#: the examples' settings (the task's defaults), given in full so that the runs' records name them
SETTINGS = Settings()
SEQUENCES = ("--retrieval-seed", "1", "--retrieval-vocabulary", str(SETTINGS.vocabulary), "--filler-vocabulary",
             str(SETTINGS.filler), "--mqar-pairs", str(SETTINGS.pairs), "--mqar-queries", str(SETTINGS.queries),
             "--passkey-digits", str(SETTINGS.passkey_digits))


#: how the board's header says each ``--train-task-mix`` sets the training examples' tasks
MIX_WORDS = {"equal-loss": "mixed so that each gives the loss as many answers", "turns": "in turn"}


def task_flags(args: argparse.Namespace) -> List[str]:
    return ["--task", "retrieval", "--retrieval-tasks", ",".join(args.tasks), *SEQUENCES]


def training(args: argparse.Namespace, name: str, seed: int) -> Step:
    """The training of model ``name`` with ``seed``: the perplexity board's model and optimiser, on the tasks
    mixed as ``--train-task-mix`` says, until it learns them or reaches ``--updates`` (:mod:`retrieval_training`)."""
    save_dir = run_dir(args, name, seed)
    task = [*task_flags(args), "--train-task-mix", args.train_task_mix,
            "--train-examples", args.updates * args.max_tokens // args.train_length]
    flags = training_flags(args, name, seed, log_interval=250, task=task, sample_break_mode=None)
    rule = {"check-every": args.check_every, "criterion": args.criterion, "check-examples": args.check_examples}
    return Step(save_dir / "trained.json", {"fairseq-train": flags, "checks": rule}, [save_dir / "checkpoint_last.pt"])


def map_tasks(args: argparse.Namespace) -> List[str]:
    return [task for task in args.tasks if task in MAP_TASKS]


def evaluation(args: argparse.Namespace, name: str, seed: int, checkpoint: Path,
               depth_map: bool = False) -> Tuple[Step, List]:
    """The evaluation of ``checkpoint`` for the board, or for the depth map (``--map-examples`` of each task with
    a needle, placed in ``--depth-bands`` in turn): its step (paths named within the run's directory) and its
    options."""
    directory = checkpoint.parent
    if depth_map:
        examples = ["--task", "retrieval", "--retrieval-tasks", ",".join(map_tasks(args)), *SEQUENCES,
                    "--depth-bands", args.depth_bands, "--valid-examples", args.map_examples]
        record, outputs = MAP_RECORD, [directory / MAP_RESULTS]
    else:
        examples = [*task_flags(args), "--valid-examples", args.examples]
        record, outputs = EVALUATION_RECORD, [directory / RESULTS, directory / SCORES]
    options = [*examples, "--path", checkpoint, "--gen-subset", "valid", "--lengths", *args.eval_lengths,
               "--max-tokens", 16384, "--cpu", "--no-progress-bar", "--results-json", outputs[0],
               *(["--example-scores", outputs[1]] if len(outputs) > 1 else []), *POSITION_ENCODINGS[name].eval_flags]
    portable = [o.name if isinstance(o, Path) and o.parent == directory else str(o) for o in options]
    step = Step(directory / record,
                {"kerple-eval-lm": portable, "checkpoint": file_digest(checkpoint) if checkpoint.is_file() else None},
                outputs)
    return step, options


def evaluations(args: argparse.Namespace) -> List[bool]:
    """Whether each evaluation of a run is the depth map's: the board's, then the map's where a task has a needle."""
    return [False, True] if map_tasks(args) else [False]


def evaluation_seconds(args: argparse.Namespace, name: str, seed: int) -> List[Optional[float]]:
    """The seconds each evaluation of :func:`evaluations` took where it holds, with these options, for the
    run's checkpoint as recorded (not read again); None for one to make."""
    checkpoint = training(args, name, seed).outputs[0]
    return [evaluation(args, name, seed, checkpoint, depth_map)[0].finished(unchecked=("checkpoint",))
            for depth_map in evaluations(args)]


def training_seconds(args: argparse.Namespace, name: str, seed: int) -> Optional[float]:
    """The seconds the run's training took where its record holds with these options, its checkpoint kept or not."""
    step = training(args, name, seed)
    return Step(step.record, step.key, []).finished()


def step_seconds(args: argparse.Namespace, name: str, seed: int) -> List[Optional[float]]:
    """The seconds each step of the run took where it holds with these options: its training, then each
    evaluation of :func:`evaluations`; None for one to make (an evaluation counts only on a training that holds)."""
    trained = training_seconds(args, name, seed)
    return [trained, *(evaluation_seconds(args, name, seed) if trained is not None else [None] * len(evaluations(args)))]


def kept(args: argparse.Namespace, name: str, seed: int) -> bool:
    """Whether the run is finished and kept without its checkpoint (committed, or copied from another machine);
    a :class:`UsageError` for one kept so whose board evaluation holds but whose depth map, with these options,
    is missing (made again, it would need the checkpoint, and training again would lose the run)."""
    if training(args, name, seed).outputs[0].is_file() or training_seconds(args, name, seed) is None:
        return False
    done = [seconds is not None for seconds in evaluation_seconds(args, name, seed)]
    if done[0] and not all(done):
        raise UsageError(f"{name}-seed{seed} is kept without its checkpoint and has no depth map made with these "
                         f"--map-examples and --depth-bands: put its checkpoint_last.pt back in "
                         f"{run_dir(args, name, seed)}, or give the options it was mapped with")
    return all(done)


def train_and_evaluate(args: argparse.Namespace, name: str, seed: int) -> float:
    """The run of ``name`` with ``seed``, each step skipped where it finished before; the seconds spent now."""
    if kept(args, name, seed):
        stage(f"{name}-seed{seed} is kept without its checkpoint, trained and evaluated so")
        return 0.0
    checkpoint, seconds = train_to_criterion(args, training(args, name, seed), task_flags(args), name, seed)
    for depth_map in evaluations(args):
        step, options = evaluation(args, name, seed, checkpoint, depth_map)
        what = "its depth map" if depth_map else "the board"
        if step.finished() is not None:
            stage(f"{name}-seed{seed} is evaluated for {what} so already")
            continue
        tasks = map_tasks(args) if depth_map else args.tasks
        stage(f"evaluating {name}-seed{seed} for {what}: {', '.join(tasks)} at lengths "
              f"{', '.join(map(str, args.eval_lengths))}")
        step.forget()
        started = time.time()
        run([sys.executable, SCRIPTS / "eval_lm.py", *options], show=lambda line: line.split(" ", 1)[0] in TASKS)
        step.complete(time.time() - started)
        seconds += time.time() - started
    return seconds


def say_cost(args: argparse.Namespace, runs: Sequence[Run]) -> None:
    """The time the unfinished runs need (a run is finished once trained and evaluated with these options, for
    the depth map too where a task has a needle): each model's own finished runs here where it has some,
    otherwise those of :func:`measured_model`, scaled by each model's cost relative to it on the perplexity board;
    less what a run's steps made already took (a run that lacks only its depth map needs the map)."""
    spent = {r: step_seconds(args, *r) for r in runs}
    finished = [r for r in runs if None not in spent[r]]
    left = [r for r in runs if r not in finished]

    def finished_seconds(run: Run, _: Path) -> Optional[Tuple[float, float]]:
        seconds = (spent.get(run) or step_seconds(args, *run)) if run[0] in args.models else [None]
        return None if None in seconds else (seconds[0], sum(seconds[1:]))

    here = model_costs(args.out, finished_seconds)
    if not here:
        stage(f"{len(runs)} runs to make; the cost of them all is said once the first is made")
        return
    relative = model_costs(args.perplexity_board) if args.perplexity_board else {}
    measured = measured_model([name for name, _ in runs], here, lambda name: trained_as(name) in (name, None))
    cost = estimate(left, measured, here, relative)
    needed = sum(max(0.0, seconds - sum(s for s in spent[r] if s is not None)) for r, seconds in cost.items())
    stage(f"cost: {len(finished)} of {len(runs)} runs are finished ({duration(sum(sum(spent[r]) for r in finished))}); "
          f"the other {len(left)} need about {hours(needed)} on this machine")


def perplexity_ranks(board_dir: Optional[Path]) -> Dict[str, int]:
    """Each model's rank on a perplexity board (its ``leaderboard.csv``) at its longest length, early-token-cursed."""
    path = board_dir / "leaderboard.csv" if board_dir else None
    if path is None or not path.is_file():
        return {}
    try:
        with open(path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r["protocol"] == "early-token-cursed"]
        longest = max(int(r["length"]) for r in rows)
        return {r["model"]: int(r["rank"]) for r in rows if int(r["length"]) == longest}
    except (KeyError, ValueError, TypeError) as e:
        raise UsageError(f"{path} is not a perplexity board's leaderboard.csv ({e}): give --perplexity-board the --out "
                         "of scripts/run-small-comparison.sh") from None


def evaluated(args: argparse.Namespace, runs: Sequence[Run]) -> List[Run]:
    return [r for r in runs if (run_dir(args, *r) / SCORES).is_file() and (run_dir(args, *r) / RESULTS).is_file()]


def trainings(args: argparse.Namespace, runs: Sequence[Run]) -> Dict[str, List[dict]]:
    """The runs' training records (``trained.json``), by model, its seeds in the order of ``runs``."""
    records: Dict[str, List[dict]] = {}
    for name, seed in runs:
        records.setdefault(name, []).append(json.loads((run_dir(args, name, seed) / "trained.json").read_text()))
    return records


def training_outcomes(trained: Dict[str, List[dict]]) -> Dict[str, str]:
    """How each model's trainings ended, by model: the updates where each seed learned the tasks, or where it
    stopped without."""
    return {name: "updates to learn: " + ", ".join(f"{r['updates']}" if r["learned"] else f"not in {r['updates']}"
                                                  for r in records)
            for name, records in trained.items()}


def trained_as(name: str) -> Optional[str]:
    """The encoding whose training ``name`` shares, evaluated without a rule of its own (rotary for its
    scalings); None where the table holds none."""
    flags = POSITION_ENCODINGS[name].model_flags()
    return next((other for other, e in POSITION_ENCODINGS.items() if not e.eval_flags and e.model_flags() == flags),
                None)


def seeds_by_model(entrants: Sequence[retrieval_board.Entrant]) -> List[str]:
    """Where the models were not all run at the same seeds, a paragraph saying which were run at which; else none."""
    groups: Dict[Tuple[int, ...], List[str]] = {}
    for e in entrants:
        groups.setdefault(tuple(e.seeds), []).append(e.label)
    if len(groups) == 1:
        return []
    common = max(groups, key=lambda seeds: len(groups[seeds]))
    return [f"Not every model is at every seed: {len(groups[common])} at {seed_words(common)}; "
            + "; ".join(f"{', '.join(labels)} at {seed_words(seeds)}" for seeds, labels in groups.items()
                        if seeds != common)
            + ". A model's mean is over its own seeds; each paired comparison is over the seeds it shares with its "
            "reference.", ""]


def _at_seeds(seeds: List[int], every: List[int]) -> str:
    """Nothing where ``seeds`` are all of ``every``, else which they are."""
    return "" if seeds == every else f" at {seed_words(seeds)}"


def unranked_reasons(args: argparse.Namespace, trained: Dict[str, List[dict]], board: retrieval_board.RetrievalBoard,
                     task: str) -> Dict[str, str]:
    """Why a model whose every seed learned the tasks by its training checks is not ranked in ``task``, by
    model: the board's validation examples are below the criterion where the checks' test examples were not;
    a rule it is evaluated with fails a seed whose trained model, evaluated without it, reaches the criterion;
    or the trained model falls short at each seed both have. Seeds are compared one by one; ``trained``: the
    runs' :func:`trainings`."""
    at_train = {e.name: dict(zip(e.seeds, board.accuracy[e.name, task, board.train_length])) for e in board.entrants}
    bar, at = f"{100 * args.criterion:g}%", f"L={args.train_length}"
    reasons = {}
    for name, records in trained.items():
        if not all(r["learned"] for r in records) or board.learned(name, task):
            continue
        rule, base = " ".join(POSITION_ENCODINGS[name].eval_flags), trained_as(name)
        mine, theirs = at_train[name], at_train.get(base, {})
        shared = [s for s in mine if s in theirs]
        failed = [s for s in shared if mine[s] < args.criterion <= theirs[s]]
        too = [s for s in shared if max(mine[s], theirs[s]) < args.criterion]
        if not rule:
            reasons[name] = f"its training checks reached {bar} at {at}; the board's examples are below it"
        elif failed:
            reasons[name] = (f"its trained model, {POSITION_ENCODINGS[base].label}, reaches {bar} at {at}"
                             f"{_at_seeds(failed, list(mine))}; evaluated with {rule}, it does not")
        elif too:
            reasons[name] = (f"its trained model, {POSITION_ENCODINGS[base].label}, is below {bar} at {at} here too"
                             f"{_at_seeds(too, list(mine))}")
        else:
            reasons[name] = (f"its trained model learned the tasks; evaluated with {rule}, it does not reach "
                             f"{bar} at {at}")
    return reasons


def board_entrant(name: str, seeds: List[int]) -> retrieval_board.Entrant:
    """A position encoding on the board at ``seeds``, compared with ALiBi and its family's baseline."""
    encoding = POSITION_ENCODINGS[name]
    return retrieval_board.Entrant(name, encoding.label, encoding.family, seeds,
                                   list(dict.fromkeys([retrieval_board.REFERENCE, encoding.baseline])))


def write_board(args: argparse.Namespace, runs: Sequence[Run]) -> str:
    """The board of the evaluated ``runs`` in ``<out>/retrieval-board.{md,csv,png}``; its markdown."""
    seeds: Dict[str, List[int]] = {}
    for name, seed in evaluated(args, runs):
        seeds.setdefault(name, []).append(seed)
    order = list(POSITION_ENCODINGS)  # the table's order, whatever the order of --models
    entrants = [board_entrant(name, s) for name, s in sorted(seeds.items(), key=lambda item: order.index(item[0]))]

    @lru_cache(maxsize=None)
    def scores_of(name: str, seed: int):
        return retrieval_accuracy.load(str(run_dir(args, name, seed) / SCORES))

    records = {r: json.loads((run_dir(args, *r) / RESULTS).read_text()) for r in evaluated(args, runs)}
    chance = {(r["task"], r["length"]): r["chance"] for r in next(iter(records.values()))}
    board = retrieval_board.build(entrants, args.train_length, scores_of, chance, args.criterion)
    ppl_rank, labels = perplexity_ranks(args.perplexity_board), {e.name: e.label for e in entrants}
    trained = trainings(args, evaluated(args, runs))
    training = training_outcomes(trained)
    every = sorted({s for e in entrants for s in e.seeds})
    seconds = sum(sum(recorded_seconds(run_dir(args, *r)) or (0, 0)) for r in evaluated(args, runs))
    shared = sorted({POSITION_ENCODINGS[e.name].architecture for e in entrants if POSITION_ENCODINGS[e.name].eval_flags})
    text = [f"# Retrieval board: {len(entrants)} position encodings, {seed_words(every)}", "",
            *seeds_by_model(entrants),
            f"Whole-answer accuracy (%) (an MQAR value, the passkey's {SETTINGS.passkey_digits} digits together, a "
            f"span of {COPY_SPAN} copied tokens), per-token accuracy in brackets, mean ± sample standard deviation "
            f"over the seeds, {args.examples} validation examples of each task at each length. Trained at "
            f"L={args.train_length} on {', '.join(args.tasks)}, {MIX_WORDS[args.train_task_mix]}, "
            f"until every task's whole answers reached {100 * args.criterion:g}% at L={args.train_length} on "
            f"{args.check_examples} held-out test examples of each (checked every {args.check_every} updates of "
            f"{args.max_tokens} tokens, at most {args.updates}); {args.layers} layer{'s' * (args.layers > 1)}, "
            f"width {args.width}, "
            f"{args.heads} heads. A model is ranked in a task only if every seed's whole answers reach "
            f"{100 * args.criterion:g}% at L={args.train_length} on the validation examples, by its mean beyond "
            f"L={args.train_length}; the others are listed below, unranked. "
            + (f"Rows of one architecture evaluated differently ({', '.join(shared)}'s scalings and rules) are one "
               "trained model per seed. " if shared else "")
            + "▲/▼: resolved above or below ALiBi (every seed's difference of the same sign and its 95% interval "
            f"excluding zero: at each end the more conservative of a paired bootstrap's over the examples, "
            f"{significance.BOARD_SAMPLES:,} resamples moved inward by its Monte-Carlo error, and a t-interval over "
            "them), marked only where both learned the task and not both are at chance (no seed above the guess "
            "among the input's symbols by two standard errors of it); the same rule gives the verdicts against "
            "each model's family baseline (what it adds to), after the seed-by-seed tables. "
            + (f"Perplexity rank: the model's rank at the longest length on {os.path.relpath(args.perplexity_board)} "
               "(early-token-cursed; blank where it holds none). " if ppl_rank else "")
            + f"Training and evaluation took {duration(seconds)} in all on this machine."]
    for task in board.tasks:
        text += ["", f"## {task}", "", retrieval_board.markdown(
            board, task, ppl_rank, training, unranked_reasons(args, trained, board, task))]
    for task in board.tasks:
        text += ["", f"## {task} at L={max(board.lengths)}, seed by seed", "",
                 retrieval_board.seed_markdown(board, task, max(board.lengths), labels)]
    for task in board.tasks:
        text += ["", f"## {task} against the family baseline", "", retrieval_board.baseline_markdown(board, task)]
    if map_tasks(args):
        text += ["", f"Accuracy by length and the depth of the needle: {DEPTH_MAP}.md (.png)."]
        write_depth_map(args, entrants)
    else:  # none of these tasks has a needle: no map of an earlier comparison left beside this board
        for suffix in (".md", ".png"):
            (args.out / f"{DEPTH_MAP}{suffix}").unlink(missing_ok=True)
    markdown = "\n".join(text) + "\n"
    write_text(str(args.out / f"{BOARD}.md"), markdown)
    write_csv(str(args.out / f"{BOARD}.csv"), *retrieval_board.csv_rows(board))
    curves = [(e.label, e.family, task, board.lengths, [board.mean(e.name, task, n) for n in board.lengths],
               [min(board.accuracy[e.name, task, n]) for n in board.lengths],
               [max(board.accuracy[e.name, task, n]) for n in board.lengths])
              for e in entrants for task in board.tasks]
    (args.out / f"{BOARD}.png").unlink(missing_ok=True)
    try:
        figures.leaderboard(curves, [f for f in FAMILIES if any(e.family == f for e in entrants)], board.tasks,
                            args.train_length, POSITION_ENCODINGS["alibi"].label, str(args.out / f"{BOARD}.png"),
                            quantity="whole-answer accuracy", log_quantity=False)
    except figures.PlotsUnavailable as e:
        stage(str(e))
    return markdown


def write_depth_map(args: argparse.Namespace, entrants: Sequence[retrieval_board.Entrant]) -> None:
    """The depth map of the ``entrants``' runs in ``<out>/retrieval-depth-map.{md,png}``."""
    records = {(e.name, seed): json.loads((run_dir(args, e.name, seed) / MAP_RESULTS).read_text())
               for e in entrants for seed in e.seeds}
    maps = [retrieval_board.DepthMap.of(task, entrants, records) for task in map_tasks(args)]
    bands = retrieval_board.band_names(args.depth_bands)
    text = [f"# Retrieval depth map: {len(entrants)} position encodings", "",
            f"Whole-answer accuracy (%) by length (rows) and by where the needle lies (columns: the share of the "
            f"noise before MQAR's key-value pairs or the passkey, in {args.depth_bands} bands; 0% is the start of "
            f"the input, the farthest from the questions), mean over the seeds; {args.map_examples} validation "
            f"examples of each task at each length, each task's examples going through the bands in turn (drawn "
            f"from the board's stream: MQAR's first {args.examples} hold the board's pairs and queries, the pairs "
            f"moved into their bands; the passkeys differ). Trained as the board says ({BOARD}.md). Nothing is pooled over "
            "lengths."]
    for depth_map in maps:
        counts = depth_map.counts
        text += ["", f"## {depth_map.task}", "",
                 f"{counts.min()} to {counts.max()} whole answers a cell and seed: a seed's cell is within "
                 f"±{depth_map.widest_interval():.1f} points (a normal 95% interval at 50%, the widest).", "",
                 retrieval_board.depth_map_markdown(depth_map, entrants)]
    write_text(str(args.out / f"{DEPTH_MAP}.md"), "\n".join(text) + "\n")
    (args.out / f"{DEPTH_MAP}.png").unlink(missing_ok=True)
    try:
        figures.depth_map([(e.label, [m.accuracy[e.name].mean(axis=0) for m in maps]) for e in entrants],
                          [m.task for m in maps], maps[0].lengths, bands, str(args.out / f"{DEPTH_MAP}.png"))
    except figures.PlotsUnavailable as e:
        stage(str(e))


def make_runs(args: argparse.Namespace, runs: Sequence[Run]) -> None:
    """Train and evaluate each of ``runs`` where it is not finished, saying the cost left as it goes."""
    say_cost(args, runs)
    for k, (name, seed) in enumerate(runs):
        spent = train_and_evaluate(args, name, seed)
        if spent and k + 1 < len(runs):
            say_cost(args, runs)


def compare(args: argparse.Namespace) -> None:
    """Every run of ``args.models`` by ``args.seeds`` (each model's first seed before any second), then the board;
    with ``args.board_only``, the board of those runs finished already, nothing made."""
    started = time.time()
    runs = [(name, seed) for seed in args.seeds for name in args.models]
    if args.board_only:
        unfinished = [r for r in runs if None in step_seconds(args, *r)]
        runs = [r for r in runs if r not in unfinished]
        if not runs:
            raise UsageError(f"--board-only: no run of these --models and --seeds is trained and evaluated with "
                             f"these options in {args.out}")
        stage(f"{len(runs)} finished runs on the board; nothing trained or evaluated"
              + ("; left out, not trained and evaluated (its depth map too) with these options: "
                 + ", ".join(f"{name}-seed{seed}" for name, seed in unfinished) if unfinished else ""))
    else:
        make_runs(args, runs)
    args.out.mkdir(parents=True, exist_ok=True)
    stage(f"the retrieval board: {args.out / BOARD}.md (.csv, .png)"
          + (f"; its depth map: {args.out / DEPTH_MAP}.md (.png)" if map_tasks(args) else ""))
    print(write_board(args, runs))
    stage(f"done in {(time.time() - started) / 60:.1f} min; results in {args.out}")

