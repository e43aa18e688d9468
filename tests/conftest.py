"""Fixtures: tiny corpora cut from the shipped data, and fairseq reference runs made once per session.

Everything else the tests share (paths, tiny models, CLI helpers) is in helpers.py.
"""

import contextlib
import os

import pytest
from hypothesis import HealthCheck, settings

# The suite tests the PyTorch path unless a test asks for the fused route itself (devices.FUSED,
# tests/core/test_fused_*.py): on CUDA (make gpu-check) the route is on by default and would otherwise take
# the calls the tests of the PyTorch path make. Set before the plugin is imported (it reads it once).
os.environ.setdefault("ATTN_REG_FUSED", "0")

# Property tests: a few hundred examples in all for `make test`, more for `make test-all`
# (HYPOTHESIS_PROFILE=thorough). No deadline: the first call of a torch op can take far longer than the rest.
settings.register_profile("default", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

from helpers import (
    CLI_STARTS,
    CORPUS,
    EVAL_BLEU,
    LOGGED_TRAIN,
    MOVIE_REVIEWS_TINY,
    RESUMABLE,
    TRAIN_ARGS,
    USER_DIR,
    fairseq_train,
    run_cli,
    run_logged_forked,
    train_updates,
)


def pytest_collection_modifyitems(config, items):
    """With ATTN_REG_PORTABLE=1 (the code an accelerator runs, forced on the CPU), a test of a
    CPU-only branch skips and says so, and so does one whose code has no device branch (``host_only``)."""
    from attn_reg_plugin.core.kernel import devices

    if devices.PORTABLE:
        skip = pytest.mark.skip(reason=f"tests the CPU's own branch; {devices.PORTABLE_ENV}=1 forces the portable one")
        host = pytest.mark.skip(reason=f"its code has no device branch: {devices.PORTABLE_ENV}=1 changes nothing there")
        for item in items:
            if item.get_closest_marker("cpu_branch"):
                item.add_marker(skip)
            elif item.get_closest_marker("host_only"):
                item.add_marker(host)


def pytest_runtest_setup(item):
    """``make test``'s two workers rely on ``xdist_group``: every real-Slurm test on one worker (the
    one-node cluster has 2 CPUs) and a module's costly session runs made once. pytest-xdist 3.8 marks a
    test's group by rewriting its id, which pytest 9.2 no longer reads: the groups were silently ignored
    (the Slurm tests shared the cluster, those runs were made twice). A grouped test on a worker of
    ``--dist loadgroup`` whose id lacks its group fails, saying so."""
    if getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group"):
        if "@" not in item.nodeid:
            import xdist

            pytest.fail(
                f"--dist loadgroup did not apply this test's xdist_group (pytest {pytest.__version__}, "
                f"pytest-xdist {xdist.__version__}): install the versions requirements.lock pins",
                pytrace=False,
            )


def pytest_sessionfinish(session):
    """Under pytest-xdist a worker hands its counts of CLI starts to the controller, which prints them."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["cli_starts"] = dict(CLI_STARTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    CLI_STARTS.update(getattr(node, "workeroutput", {}).get("cli_starts", {}))


def pytest_terminal_summary(terminalreporter):
    """How the tests' fairseq-train, -generate and -preprocess runs started (tests/forked_cli.py)."""
    if CLI_STARTS:
        starts = ", ".join(f"{n} {how}" for how, n in CLI_STARTS.most_common())
        terminalreporter.write_line(f"fairseq-train/-generate/-preprocess runs of the tests: {starts}")


@pytest.fixture(autouse=True, scope="session")
def _forked_preprocess():
    """attn-reg-prepare's fairseq-preprocess (``prepare.run_logged``), when the tests call ``prepare``
    in-process, as a fork of the forked-CLI server (helpers.run_logged_forked: the same command, log
    and failure message) instead of a fresh start, 5 s of imports each. The command itself
    (tests/test_prepare.py's ``attn-reg-prepare`` runs) keeps its own Popen."""
    from attn_reg_plugin import prepare

    real = prepare.run_logged

    def logged(cmd, log_path, on_line=None, env=None, append=False):
        seconds = None if env else run_logged_forked(cmd, log_path, on_line, append)
        return real(cmd, log_path, on_line, env, append) if seconds is None else seconds

    prepare.run_logged = logged
    yield
    prepare.run_logged = real


_LEFT_GROUP = []  # the test that left a process group in pytest's process, once said


def _gloo_threads():
    """The names of the gloo threads of this process (Linux: /proc), none where it cannot tell."""
    names = []
    with contextlib.suppress(OSError):
        for task in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
    return [name for name in names if "gloo" in name]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    """No test leaves a process group in pytest's process: a DistributedDataParallel module keeps its
    gloo group (two worker threads, the transport's loop, the store) alive after destroy_process_group,
    for the rest of the session and under every later fork of this process. Such a test runs its group
    in a process of its own (helpers.in_child). Said once, by the test that left it."""
    import torch.distributed as dist

    left = _gloo_threads()
    if ((dist.is_available() and dist.is_initialized()) or left) and not _LEFT_GROUP:
        _LEFT_GROUP.append(item.nodeid)
        raise RuntimeError(
            f"{item.nodeid} left a torch.distributed process group in pytest's process (threads: {left})"
        )


@pytest.fixture()
def forked_runs(monkeypatch):
    """The sweep's and the lab's fairseq-train and fairseq-generate runs as forks of the tests'
    forked-CLI server (helpers.run_logged_forked); any other command as the product runs it."""
    from attn_reg_plugin.sweep import runs

    real_appended = runs.run_appended

    def appended(cmd, log_path, on_line=None, on_tick=None):
        seconds = run_logged_forked(cmd, log_path, on_line)
        if seconds is None:
            return real_appended(cmd, log_path, on_line, on_tick)
        if on_tick is not None:
            on_tick(seconds)
        return seconds

    monkeypatch.setattr(runs, "run_appended", appended)
    mt_pipeline = pytest.importorskip("attn_reg_lab.mt_pipeline")
    real_logged = mt_pipeline.run_logged

    def logged(cmd, log_path, on_line=None, env=None, append=False):
        seconds = None if env else run_logged_forked(cmd, log_path, on_line, append)
        return real_logged(cmd, log_path, on_line, env, append) if seconds is None else seconds

    monkeypatch.setattr(mt_pipeline, "run_logged", logged)


@pytest.fixture(scope="session")
def tiny_mt_data(tmp_path_factory):
    """120/40/40 pairs of the shipped corpus, sentencepiece'd and binarized by fairseq-preprocess."""
    from attn_reg_plugin.prepare import prepare

    root = tmp_path_factory.mktemp("tiny_mt")
    raw = root / "raw"
    raw.mkdir()
    sizes = {"train": 120, "valid": 40, "test": 40}
    for split, n in sizes.items():
        for lang in ("en", "ro"):
            lines = (CORPUS / f"{split}.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)[:n]
            (raw / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
    data_bin = prepare("en", "ro", {split: raw / split for split in sizes}, root, vocab_size=300, log=lambda s: None)
    return {"raw": raw, "bin": data_bin, "root": root}


@pytest.fixture(scope="session")
def tiny_sp_data(tmp_path_factory):
    """Sentence classification / regression data-bins (GLUE layout) from the 64 tiny movie reviews.

    train = first 48 reviews, valid = last 16; a 200-piece sentencepiece model trained on the
    train sentences; ``input0`` binarized by fairseq-preprocess (its own dictionary), ``label``
    binarized with --only-source for classification, raw float lines for regression.
    """
    import json

    import sentencepiece as spm

    root = tmp_path_factory.mktemp("tiny_sp")
    rows = [json.loads(line) for line in MOVIE_REVIEWS_TINY.read_text(encoding="utf-8").splitlines() if line.strip()]
    splits = {"train": rows[:48], "valid": rows[48:]}
    raw = root / "raw"
    raw.mkdir()
    for split, part in splits.items():
        (raw / f"{split}.sentence").write_text("".join(r["sentence"] + "\n" for r in part), encoding="utf-8")
        (raw / f"{split}.label").write_text("".join(f"{r['label']}\n" for r in part), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(raw / "train.sentence"),
        model_prefix=str(root / "spm"),
        vocab_size=200,
        character_coverage=1.0,
        model_type="unigram",
        num_threads=1,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_file=str(root / "spm.model"))
    for split in splits:
        lines = (raw / f"{split}.sentence").read_text(encoding="utf-8").splitlines()
        (raw / f"{split}.spm").write_text(
            "".join(" ".join(sp.encode(s, out_type=str)) + "\n" for s in lines), encoding="utf-8"
        )

    cls, reg = root / "cls-bin", root / "reg-bin"
    run_cli(
        "fairseq-preprocess",
        [
            "--only-source",
            "--trainpref",
            raw / "train.spm",
            "--validpref",
            raw / "valid.spm",
            "--destdir",
            cls / "input0",
            "--workers",
            "1",
        ],
    )
    run_cli(
        "fairseq-preprocess",
        [
            "--only-source",
            "--trainpref",
            raw / "train.label",
            "--validpref",
            raw / "valid.label",
            "--destdir",
            cls / "label",
            "--workers",
            "1",
        ],
    )
    # Regression reads label/<split>.label as text, one float per line (--num-classes 1).
    (reg / "label").mkdir(parents=True)
    import shutil

    shutil.copytree(cls / "input0", reg / "input0")
    for split, part in splits.items():
        (reg / "label" / f"{split}.label").write_text("".join(f"{float(r['label'])}\n" for r in part), encoding="utf-8")
    return {"cls": cls, "reg": reg, "raw": raw, "root": root}


@pytest.fixture(scope="session")
def reference_runs(tiny_mt_data, tmp_path_factory):
    """name -> one uninterrupted 3-epoch fairseq-train run of TRAIN_ARGS[name] + RESUMABLE, made once."""
    runs = {}

    def get(name):
        if name not in runs:
            save = tmp_path_factory.mktemp(f"{name}_run")
            proc = fairseq_train(
                tiny_mt_data["bin"],
                [
                    "--save-dir",
                    save,
                    *TRAIN_ARGS[name],
                    *RESUMABLE,
                    "--max-epoch",
                    "3",
                ],
            )
            runs[name] = {"save": save, "log": proc.stdout, "updates": train_updates(proc.stdout)}
        return runs[name]

    return get


@pytest.fixture(scope="session")
def ad_drop_run(reference_runs):
    """The AD-DROP reference run: epoch 1 plain, epoch 2 AD-DROP, epoch 3 plain."""
    return reference_runs("ad_drop")


@pytest.fixture(scope="session")
def logged_runs(tiny_mt_data, tmp_path_factory):
    """name -> one 2-epoch fairseq-train run of LOGGED_TRAIN[name], made once: its output ("log"), per-update
    JSON records ("updates"), epoch checkpoints ("save": checkpoint1.pt, checkpoint2.pt) and TensorBoard
    event files ("tb", --tensorboard-logdir)."""
    runs = {}

    def get(name):
        if name not in runs:
            root = tmp_path_factory.mktemp(f"{name}_logged")
            proc = fairseq_train(
                tiny_mt_data["bin"],
                [
                    "--save-dir",
                    root / "ckpt",
                    "--tensorboard-logdir",
                    root / "tb",
                    *LOGGED_TRAIN[name],
                ],
            )
            runs[name] = {
                "save": root / "ckpt",
                "tb": root / "tb",
                "log": proc.stdout,
                "updates": train_updates(proc.stdout),
            }
        return runs[name]

    return get


@pytest.fixture(scope="session")
def eval_bleu_run(tiny_mt_data, tmp_path_factory):
    """A plain 2-epoch run (LOGGED_TRAIN["plain"]) validated by BLEU and keeping its best checkpoint by
    it (EVAL_BLEU): "save" holds checkpoint1.pt, checkpoint2.pt, checkpoint_best.pt, checkpoint_last.pt;
    "args" is its fairseq-train argument list after the data-bin."""
    save = tmp_path_factory.mktemp("eval_bleu") / "ckpt"
    args = ["--user-dir", USER_DIR, "--save-dir", save, *LOGGED_TRAIN["plain"], *EVAL_BLEU]
    proc = run_cli("fairseq-train", [tiny_mt_data["bin"], *args])
    return {"save": save, "args": args, "log": proc.stdout}
