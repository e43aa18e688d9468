"""A joint data-bin serves both directions, so fairseq-generate set up in one direction loads a
checkpoint trained in the other without complaint and translates the wrong side. The attn_reg task
compares the checkpoint's direction with its own before decoding and refuses the reverse, naming
-s/-t and both directions (docs/FAIRSEQ.md "Translation with AD-DROP")."""

import re

import pytest

pytest.importorskip("fairseq")

from helpers import LOGGED_TRAIN, USER_DIR, fairseq_train, run_cli  # noqa: E402

GENERATE = ["--user-dir", USER_DIR, "--task", "attn_reg_translation", "--cpu", "--beam", "1", "--max-len-b", "5"]
GENERATE += ["--required-batch-size-multiple", "1", "--remove-bpe", "sentencepiece"]


@pytest.fixture(scope="module")
def ro_en_checkpoint(tiny_mt_data, tmp_path_factory):
    """One epoch trained RO->EN (-s ro -t en) on the EN-RO data-bin."""
    save = tmp_path_factory.mktemp("ro_en")
    fairseq_train(tiny_mt_data["bin"], ["--save-dir", save, "-s", "ro", "-t", "en", *LOGGED_TRAIN["plain"]])
    return save / "checkpoint_last.pt"


def test_generate_refuses_the_reverse_of_the_trained_direction(tiny_mt_data, ro_en_checkpoint):
    """Without -s/-t fairseq-generate reads the data-bin as its own pair, en->ro: it translated the
    English side and scored it against the Romanian references, silently."""
    for direction in ([], ["-s", "en", "-t", "ro"]):
        gen = run_cli(
            "fairseq-generate",
            [tiny_mt_data["bin"], "--path", ro_en_checkpoint, *GENERATE, *direction],
            expect_ok=False,
        )
        assert gen.returncode != 0 and not re.search(r"^D-\d+\t", gen.stdout, flags=re.M)
        assert (
            "ValueError: the checkpoint was trained ro->en (-s ro -t en), but this command reads the data en->ro"
            in gen.stdout
        )
        assert "Pass -s ro -t en (--source-lang/--target-lang)" in gen.stdout


def test_generate_in_the_trained_direction(tiny_mt_data, ro_en_checkpoint):
    gen = run_cli(
        "fairseq-generate", [tiny_mt_data["bin"], "--path", ro_en_checkpoint, *GENERATE, "-s", "ro", "-t", "en"]
    )
    targets = dict(re.findall(r"^T-(\d+)\t(.*)$", gen.stdout, flags=re.M))
    # the references are the English side (sentencepiece's normaliser squeezes runs of spaces)
    english = [" ".join(line.split()) for line in (tiny_mt_data["raw"] / "test.en").read_text("utf-8").splitlines()]
    assert len(targets) == 40 and all(targets[str(i)] == english[i] for i in range(40))


def test_a_direction_inferred_in_training_is_read_from_its_data_bin(tiny_mt_data, eval_bleu_run):
    """A run without -s/-t saves no direction (fairseq keeps the options as given): the task reads the
    pair its training inferred from the checkpoint's data-bin, here en->ro, and refuses ro->en."""
    gen = run_cli(
        "fairseq-generate",
        [tiny_mt_data["bin"], "--path", eval_bleu_run["save"] / "checkpoint1.pt", *GENERATE, "-s", "ro", "-t", "en"],
        expect_ok=False,
    )
    assert "the checkpoint was trained en->ro (-s en -t ro), but this command reads the data ro->en" in gen.stdout


def test_a_checkpoint_of_unknown_direction_is_not_refused(tmp_path):
    """No -s/-t saved and its data-bin gone: nothing to compare, the command runs as before."""
    from omegaconf import OmegaConf

    from attn_reg_plugin.fairseq_plugin.attn_reg_translation import refuse_reversed_direction, trained_direction

    gone = OmegaConf.create({"data": str(tmp_path / "moved"), "source_lang": None, "target_lang": None})
    assert trained_direction(gone) == (None, None)
    refuse_reversed_direction(gone, "en", "ro")
    given = OmegaConf.create({"data": str(tmp_path / "moved"), "source_lang": "ro", "target_lang": "en"})
    refuse_reversed_direction(given, "ro", "en")
    with pytest.raises(ValueError, match=r"trained ro->en \(-s ro -t en\)"):
        refuse_reversed_direction(given, "en", "ro")
