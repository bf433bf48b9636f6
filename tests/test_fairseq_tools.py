"""fairseq's own tools with the plugin's models, for every position encoding: fairseq-train in every
``--sample-break-mode``, fairseq-hydra-train from ``docs/hydra``, fairseq-eval-lm, fairseq-generate and
fairseq-interactive sampling, and the hub interface (``from_pretrained``, ``score``, ``sample``). Each
is checked against the plugin's own full scoring of the same tokens, not only for running: what the
generators print as each token's log-probability (computed step by step, with the key/value cache) is
what one forward pass over the whole text gives, and a batch scores and generates as its sentences
do one at a time."""

import math
import re

import pytest
import torch
from omegaconf import OmegaConf
from fairseq.models.transformer_lm import TransformerLanguageModel

from conftest import (REPO, TRAIN_LENGTH, eval_lm_result, fairseq_cli, run, stock_eval_lm_args,
                      train_in_process)
from console_scripts import run_each_forked
from helpers import every_encoding
from kerple_core.attention.methods import attention_method_option_fields
from kerple_core.kernels import option_fields
from kerple_core.layer_biases import layer_bias_option_fields
from kerple_core.visibility import visibility_rule_option_fields
from kerple_fairseq.models.config import KernelBiasedLMConfig
from kerple_fairseq.evaluation.loading import load_language_model, token_stream
from kerple_fairseq.evaluation.scorer import WindowScorer
from kerple_fairseq.evaluation.spans import early_token_cursed
from kerple_fairseq.experiments.language_models import model_size_flags, parse_model_flags
from kerple_fairseq.experiments.position_encodings import POSITION_ENCODINGS, position_encoding

pytestmark = pytest.mark.slow

USER_DIR = str(REPO / "kerple_fairseq")
#: the split fairseq-eval-lm scores for each checkpoint (half as many tokens as the valid split)
EVAL_SPLIT = "test"


ENCODINGS = every_encoding()
# the stock command-line tools' encodings: the comparison's and learned positions
TOOL_ENCODINGS = [*POSITION_ENCODINGS, "learned_pos"]
PROMPTS = ["The game was released in", "In 1998 the", "He was born in the city of"]


@pytest.fixture(scope="module")
def sentence_trained(data_bin, tmp_path_factory):
    """A checkpoint of every encoding, trained with ``--sample-break-mode eos`` (padded batches of
    sentences); by name."""
    out = {}
    for name, flags in ENCODINGS.items():
        save_dir = tmp_path_factory.mktemp(f"eos-{name}")
        losses = train_in_process(data_bin, save_dir, 4, *flags, "--sample-break-mode", "eos")
        assert len(losses) == 4 and all(math.isfinite(x) for x in losses), (name, losses)
        out[name] = save_dir / "checkpoint_last.pt"
    return out


@pytest.mark.parametrize("mode", ["complete", "complete_doc"])
def test_fairseq_train_in_every_sample_break_mode(data_bin, tmp_path, mode):
    """``none`` is how every other test trains, ``eos`` trains the checkpoints here; these two pack
    whole sentences (and documents) into padded samples."""
    for name, flags in ENCODINGS.items():
        losses = train_in_process(data_bin, tmp_path / name, 2, *flags, "--sample-break-mode", mode)
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses), (name, mode, losses)


def test_fairseq_train_command_with_sentence_samples(data_bin, tmp_path):
    """The installed fairseq-train, as a user types it, in the mode that NumPy 2 broke in fairseq 0.12."""
    for mode in ("eos", "complete_doc"):
        run([fairseq_cli("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--task", "language_modeling",
             "--arch", "transformer_lm_alibi", *model_size_flags(layers=1, width=32, heads=4),
             "--tokens-per-sample", "64", "--sample-break-mode", mode, "--max-tokens", "512",
             "--optimizer", "adam", "--lr", "0.001", "--max-update", "2", "--cpu", "--num-workers", "0",
             "--disable-validation", "--save-dir", tmp_path / mode])
        assert (tmp_path / mode / "checkpoint_last.pt").is_file()


# ------------------------------------------------------------------------------------ full scoring

def full_log_probs(model, tokens):
    """Natural-log probabilities of ``tokens`` (ending with the end-of-sentence symbol), each given the
    ones before it and the end-of-sentence symbol that starts every text, in one forward pass."""
    eos = model.decoder.dictionary.eos()
    inputs = torch.cat([tokens.new_tensor([eos]), tokens[:-1]])[None]
    with torch.no_grad():
        lprobs = model.get_normalized_probs(model(inputs), log_probs=True)[0]
    return lprobs.gather(-1, tokens[:, None]).squeeze(-1)


def hub_model(checkpoint, data_bin):
    return TransformerLanguageModel.from_pretrained(str(checkpoint.parent), checkpoint.name,
                                                    data_name_or_path=str(data_bin)).eval()


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_hub_interface_scores_and_samples_as_full_scoring(sentence_trained, data_bin, name):
    lm = hub_model(sentence_trained[name], data_bin)
    model = lm.models[0]
    # score: each word's log-probability (not the end of the sentence) from one forward pass over the
    # text; a batch of unequal sentences scores each as alone
    alone = [lm.score(p)["positional_scores"] for p in PROMPTS]
    for prompt, scores in zip(PROMPTS, alone):
        torch.testing.assert_close(scores, full_log_probs(model, lm.encode(prompt))[:-1], rtol=0, atol=1e-5)
    for scores, single in zip(lm.score(PROMPTS), alone):
        torch.testing.assert_close(scores["positional_scores"], single, rtol=0, atol=1e-5)
    # generation: step by step through the cache, every token's score as full scoring gives it
    for sampling in ({"beam": 1}, {"beam": 1, "sampling": True, "sampling_topk": 5}):
        torch.manual_seed(0)
        hypothesis = lm.generate([lm.encode(PROMPTS[0])], max_len_b=24, **sampling)[0][0]
        assert hypothesis["tokens"].numel() > len(PROMPTS[0].split()) + 1, name
        torch.testing.assert_close(hypothesis["positional_scores"], full_log_probs(model, hypothesis["tokens"]),
                                   rtol=0, atol=1e-4)
    # sample: text that continues the prompt; greedy in a batch of unequal prompts as one at a time
    greedy = [lm.sample(p, beam=1, max_len_b=16) for p in PROMPTS]
    assert all(text.startswith(p + " ") for text, p in zip(greedy, PROMPTS)), greedy
    assert lm.sample(PROMPTS, beam=1, max_len_b=16) == greedy
    torch.manual_seed(1)
    sampled = lm.sample(PROMPTS, beam=1, sampling=True, sampling_topk=10, max_len_b=16)
    assert all(text.startswith(p + " ") for text, p in zip(sampled, PROMPTS)), sampled


# ------------------------------------------------------------------------------------ command line

@pytest.fixture(scope="module")
def prompts_bin(data_bin, tmp_path_factory):
    """A data-bin whose test split is :data:`PROMPTS`, with ``data_bin``'s dictionary."""
    raw = tmp_path_factory.mktemp("prompts")
    for split in ("train", "valid", "test"):
        (raw / f"wiki.{split}.tokens").write_text("".join(p + "\n" for p in PROMPTS))
    dest = tmp_path_factory.mktemp("prompts-bin") / "data-bin"
    run([fairseq_cli("fairseq-preprocess"), "--only-source", "--srcdict", data_bin / "dict.txt", "--destdir", dest,
         "--testpref", raw / "wiki.test.tokens", "--workers", "1"])
    return dest


def printed_hypotheses(output: str):
    """``{id: (words, base-2 positional scores)}`` from the H- and P- lines fairseq prints."""
    words = {int(i): text.split() for i, text in re.findall(r"^H-(\d+)\t\S+\t?(.*)$", output, re.M)}
    scores = {int(i): [float(x) for x in s.split()] for i, s in re.findall(r"^P-(\d+)\t(.*)$", output, re.M)}
    assert words and words.keys() == scores.keys(), output[-3000:]
    return {i: (words[i], scores[i]) for i in words}


def assert_printed_as_full_scoring(model, dictionary, output: str, prompts):
    """Every printed hypothesis continues its prompt, and its printed scores (base 2, 4 decimals) are
    those of full scoring."""
    printed = printed_hypotheses(output)
    assert len(printed) == len(prompts), printed
    for i, (words, scores) in printed.items():
        prompt = prompts[i].split()
        assert words[:len(prompt)] == prompt and len(words) > len(prompt), (prompts[i], words)
        tokens = dictionary.encode_line(" ".join(words), add_if_not_exist=False).long()
        expected = full_log_probs(model, tokens) / math.log(2)
        torch.testing.assert_close(torch.tensor(scores), expected.float(), rtol=0, atol=2e-4)


def sampling_flags(*extra):
    return ["--user-dir", USER_DIR, "--task", "language_modeling", "--cpu", "--num-workers", "0", "--beam", "1",
            "--sampling", "--sampling-topk", "10", "--seed", "1", "--max-len-b", "16", *extra]


GENERATE = ["--gen-subset", "test", "--prefix-size", "3", "--sample-break-mode", "eos", "--max-tokens", "512",
            "--required-batch-size-multiple", "1"]


@pytest.fixture(scope="module")
def tool_runs(sentence_trained, data_bin, prompts_bin, tmp_path_factory):
    """fairseq-eval-lm, fairseq-generate and fairseq-interactive on each of :data:`TOOL_ENCODINGS`'
    checkpoints, each through its console script's entry point, forked from one process; by name, the
    three runs' ``CompletedProcess``."""
    prompts = tmp_path_factory.mktemp("interactive") / "prompts.txt"
    prompts.write_text("".join(p + "\n" for p in PROMPTS))
    runs = []
    for name in TOOL_ENCODINGS:
        checkpoint = sentence_trained[name]
        eval_lm = stock_eval_lm_args(data_bin, checkpoint, TRAIN_LENGTH, "--user-dir", USER_DIR, split=EVAL_SPLIT)
        runs += [("fairseq-eval-lm", eval_lm, REPO),
                 ("fairseq-generate", [prompts_bin, "--path", checkpoint, *GENERATE, *sampling_flags()], REPO),
                 ("fairseq-interactive", [data_bin, "--path", checkpoint, "--input", prompts, "--buffer-size", "3",
                                          "--batch-size", "3", *sampling_flags()], REPO)]
    done = run_each_forked(runs, check=False)
    return {name: done[3 * i: 3 * i + 3] for i, name in enumerate(TOOL_ENCODINGS)}


def test_the_tools_in_one_process_are_the_installed_commands(tool_runs, sentence_trained, data_bin, prompts_bin):
    """What the tests below read from one process running the three tools for every checkpoint is what
    each installed command prints when started alone."""
    checkpoint = sentence_trained["alibi"]
    eval_lm, generate, _ = tool_runs["alibi"]
    alone = run([fairseq_cli("fairseq-eval-lm"), *stock_eval_lm_args(data_bin, checkpoint, TRAIN_LENGTH, "--user-dir",
                                                                     USER_DIR, split=EVAL_SPLIT)])
    assert eval_lm_result(alone) == eval_lm_result(eval_lm)
    alone = run([fairseq_cli("fairseq-generate"), prompts_bin, "--path", checkpoint, *GENERATE, *sampling_flags()])
    assert printed_hypotheses(alone.stdout) == printed_hypotheses(generate.stdout)


@pytest.mark.parametrize("name", TOOL_ENCODINGS)
def test_eval_lm_generate_and_interactive(tool_runs, sentence_trained, data_bin, name):
    eval_lm, generated, interactive = tool_runs[name]
    for proc in tool_runs[name]:
        assert proc.returncode == 0, f"{proc.args[0]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    model, task, _ = load_language_model(str(sentence_trained[name]), str(data_bin))
    model.eval()
    # fairseq-eval-lm: the plugin's own scorer over the same blocks
    tokens, loss, _ = eval_lm_result(eval_lm)
    stream = token_stream(task, str(data_bin), EVAL_SPLIT)
    inputs = torch.cat([stream.new_tensor([task.source_dictionary.eos()]), stream[:-1]])
    scores = WindowScorer(model, inputs, stream, 4096, "cpu", progress=False).score(
        early_token_cursed(len(stream), TRAIN_LENGTH))
    total = sum(float(s.astype("float64").sum()) for s in scores)
    assert tokens == len(stream) and loss == pytest.approx(-total / len(stream) / math.log(2), abs=2e-4)
    # fairseq-generate: sampled continuations of the test split's first three words
    prefixes = {i: " ".join(p.split()[:3]) for i, p in enumerate(PROMPTS)}
    assert_printed_as_full_scoring(model, task.source_dictionary, generated.stdout, prefixes)
    # fairseq-interactive: prompts read from a file, three to a batch
    assert_printed_as_full_scoring(model, task.source_dictionary, interactive.stdout, dict(enumerate(PROMPTS)))


# ------------------------------------------------------------------------------------ hydra

HYDRA_MODEL = ["model.decoder_layers=2", "model.decoder_embed_dim=32", "model.decoder_ffn_embed_dim=64",
               "model.decoder_attention_heads=4"]
HYDRA_RUN = ["task.tokens_per_sample=64", "dataset.max_tokens=512", "optimization.max_update=3", "common.cpu=true",
             "common.seed=5", "dataset.num_workers=0", "dataset.disable_validation=true"]
#: the model options that say how a model encodes position
POSITION_KEYS = ["bias_kernel", "rotary_embeddings", "rotary_xpos", "rotary_fraction", "token_positional_embeddings",
                 "decoder_learned_pos", "attn_window", "layer_positions",
                 *(f.name for f in option_fields() + layer_bias_option_fields() + visibility_rule_option_fields()
                   + attention_method_option_fields())]


def hydra_keys(name):
    """The YAML's model keys of the comparison's position encoding ``name``: each position option that its
    flags (its architecture's defaults included) set otherwise than the YAML, or than the option's default
    for an option the YAML lacks (added with Hydra's ``+``)."""
    yaml = OmegaConf.load(REPO / "docs" / "hydra" / "kerple_lm.yaml").model
    args = parse_model_flags(position_encoding(name).model_flags())
    keys = []
    for key in POSITION_KEYS:
        default = KernelBiasedLMConfig.__dataclass_fields__[key].default
        value = getattr(args, key, default)  # fairseq leaves out the model options not given
        stated = yaml[key] if key in yaml else default
        if str(value) != str(stated):
            text = str(value).lower() if isinstance(value, bool) else str(value)
            text = f"'{text}'" if "," in text else text  # Hydra reads an unquoted comma as a list (a plan's entries)
            keys.append(f"{'' if key in yaml else '+'}model.{key}={text}")
    return keys


# the comparison's encodings that train a model of their own (every architecture among them)
HYDRA_ENCODINGS = [name for name, encoding in POSITION_ENCODINGS.items()
                   if not encoding.eval_flags and name not in ("nope", "t5", "kerple_log", "dape_alibi", "fire")]


def test_hydra_keys_are_derived_from_the_table():
    assert hydra_keys("alibi") == ["model.bias_kernel=alibi"]
    assert hydra_keys("kerple_log") == []
    assert hydra_keys("xpos") == ["model.bias_kernel=none", "model.rotary_embeddings=true", "model.rotary_xpos=true"]
    assert hydra_keys("sinusoidal") == ["model.bias_kernel=none", "model.token_positional_embeddings=true"]
    assert hydra_keys("dape_kerple_log") == ["model.dape=mlp"]


FLAGS_RUN = ["--tokens-per-sample", "64", "--sample-break-mode", "none", "--max-tokens", "512",
             "--criterion", "cross_entropy", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--weight-decay", "0.01",
             "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "4000", "--lr", "0.0005", "--clip-norm", "1.0",
             "--max-update", "3", "--cpu", "--seed", "5", "--num-workers", "0", "--disable-validation",
             "--no-epoch-checkpoints"]


def hydra_train_args(name, data_bin, folder):
    """fairseq-hydra-train's arguments for encoding ``name``, saving into ``folder``/hydra."""
    return ["--config-dir", REPO / "docs" / "hydra", "--config-name", "kerple_lm", f"task.data={data_bin}",
            f"common.user_dir={USER_DIR}", *hydra_keys(name), *HYDRA_MODEL, *HYDRA_RUN,
            f"checkpoint.save_dir={folder / 'hydra'}", f"hydra.run.dir={folder / 'hydra-outputs'}"]


@pytest.fixture(scope="module")
def hydra_and_flags(data_bin, tmp_path_factory):
    """For each of :data:`HYDRA_ENCODINGS`, a model trained by ``fairseq-hydra-train`` with
    ``docs/hydra/kerple_lm.yaml`` and one trained by ``fairseq-train`` with the same options (the
    YAML's, written as flags), through the console scripts' entry points, forked from one process; by name,
    the two runs' save folders."""
    runs, folders = [], {}
    for name in HYDRA_ENCODINGS:
        folder = tmp_path_factory.mktemp(f"hydra-{name}")
        runs += [("fairseq-hydra-train", hydra_train_args(name, data_bin, folder), folder),
                 ("fairseq-train",
                  [data_bin, "--user-dir", USER_DIR, "--task", "language_modeling", *position_encoding(name).model_flags(),
                   *model_size_flags(layers=2, width=32, heads=4, dropout=0.1), *FLAGS_RUN,
                   "--save-dir", folder / "flags"], REPO)]
        folders[name] = (folder / "hydra", folder / "flags")
    run_each_forked(runs)
    return folders


@pytest.mark.parametrize("name", HYDRA_ENCODINGS)
def test_hydra_config_trains_the_model_fairseq_train_does(hydra_and_flags, name):
    """``fairseq-hydra-train`` with ``docs/hydra/kerple_lm.yaml`` gives, update for update, the model that
    fairseq-train gives with the same options."""
    hydra_dir, flags_dir = hydra_and_flags[name]
    hydra = torch.load(hydra_dir / "checkpoint_last.pt", weights_only=True)["model"]
    flags = torch.load(flags_dir / "checkpoint_last.pt", weights_only=True)["model"]
    assert hydra.keys() == flags.keys()
    for key in flags:
        assert torch.equal(hydra[key], flags[key]), key


def test_hydra_train_alone_is_what_it_is_among_others(hydra_and_flags, data_bin, tmp_path):
    """The installed fairseq-hydra-train started alone saves the model it saves in the process that
    runs every encoding's training."""
    name = HYDRA_ENCODINGS[-1]
    run([fairseq_cli("fairseq-hydra-train"), *hydra_train_args(name, data_bin, tmp_path)], cwd=tmp_path)
    alone = torch.load(tmp_path / "hydra" / "checkpoint_last.pt", weights_only=True)["model"]
    among = torch.load(hydra_and_flags[name][0] / "checkpoint_last.pt", weights_only=True)["model"]
    assert alone.keys() == among.keys()
    for key in alone:
        assert torch.equal(alone[key], among[key]), key


# ------------------------------------------------------------------------------------ --task

@pytest.mark.parametrize("extra", [[], ["--tokens-per-sample", "64"]])
def test_plugin_architecture_without_task_is_one_line(data_bin, tmp_path, extra):
    proc = run([fairseq_cli("fairseq-train"), data_bin, "--user-dir", USER_DIR, "--arch", "transformer_lm_kerple",
                "--cpu", "--max-update", "1", "--save-dir", tmp_path / "run", *extra], check=False)
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors) == 1 and "add --task language_modeling" in errors[0], proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()
