"""examples/opus_mt: the OPUS-MT fine-tuning script's own code path, offline.

A tiny random MarianMTModel + MarianTokenizer (build_tiny_marian.py, sentencepiece trained on
the shipped corpus) stands in for Helsinki-NLP/opus-mt-en-ro, and a slice of
data/gettext_en_ro stands in for WMT16; everything else is what a real run executes.
"""

import json
import math

import pytest
import sacrebleu

from helpers import CORPUS, REPO, load_script

EXAMPLE = REPO / "examples" / "opus_mt"


opus = load_script(EXAMPLE / "run_opus_mt.py", "run_opus_mt")
tiny = load_script(EXAMPLE / "build_tiny_marian.py", "build_tiny_marian")

pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")


@pytest.fixture(scope="module")
def tiny_marian(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_marian")
    tiny.build(path, CORPUS, "en", "ro", train_lines=400, vocab_size=300, d_model=32, layers=2, heads=4, ffn_dim=64)
    return path


def _slice(root, sizes):
    root.mkdir()
    for split, n in sizes.items():
        for lang in ("en", "ro"):
            lines = (CORPUS / f"{split}.{lang}").read_text(encoding="utf-8").splitlines(keepends=True)[:n]
            (root / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
    return root


def test_tiny_marian_loads_like_an_opus_mt_checkpoint(tiny_marian):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_marian)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(tiny_marian)
    assert type(tok).__name__ == "MarianTokenizer" and type(model).__name__ == "MarianMTModel"
    enc = tok(["Sort column ID"], text_target=["ID coloană de sortare"])
    assert enc["labels"][0][-1] == model.config.eos_token_id == 0
    assert tok.decode(enc["labels"][0], skip_special_tokens=True) == "ID coloană de sortare"
    assert tok.pad_token_id == model.config.pad_token_id == model.config.decoder_start_token_id


def test_plain_and_ad_drop_runs_log_rate_and_bleu(tmp_path, tiny_marian, capsys):
    data = _slice(tmp_path / "data", {"train": 48, "valid": 12, "test": 10})
    out = tmp_path / "out"
    p, q = 0.3, 0.3
    assert (
        opus.main(
            [
                "--pair",
                "en-ro",
                "--out",
                str(out),
                "--model",
                str(tiny_marian),
                "--data-dir",
                str(data),
                "--epochs",
                "2",
                "--batch-size",
                "8",
                "--lr",
                "1e-3",
                "--num-beams",
                "2",
                "--max-new-tokens",
                "16",
                "--ad-drop-p",
                str(p),
                "--ad-drop-q",
                str(q),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    results = {r["method"]: r for r in json.loads((out / "results.json").read_text())}
    assert list(results) == ["plain", "ad-drop"]
    plain, ad = results["plain"]["epochs"], results["ad-drop"]["epochs"]
    assert [r["epoch"] for r in plain] == [r["epoch"] for r in ad] == [1, 2]
    assert all(r["ad_drop_rate"] is None for r in plain)  # the stock Seq2SeqTrainer
    assert ad[0]["ad_drop_on"] == 0 and ad[0]["ad_drop_rate"] == 0
    assert ad[1]["ad_drop_on"] == 1 and 0.5 * p * q < ad[1]["ad_drop_rate"] < p * q + 0.05, ad[1]
    for r in plain + ad:
        assert math.isfinite(r["train_loss"]) and math.isfinite(r["eval_loss"])
    # Epoch 1 is plain in both runs, from the same checkpoint and seed: identical losses.
    assert plain[0]["train_loss"] == ad[0]["train_loss"]
    for r in results.values():
        hyps = (out / r["method"] / "test.hyp").read_text(encoding="utf-8").splitlines()
        refs = (data / "test.ro").read_text(encoding="utf-8").splitlines()
        assert r["test_sentences"] == len(hyps) == len(refs) == 10 and r["bleu_signature"].startswith("BLEU")
        assert r["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)  # scored on what was written
    assert "| ad-drop |" in printed and f"drop rate {ad[1]['ad_drop_rate']:.4f}" in printed


def _fake_wmt16(rows_by_split):
    calls = []

    def load_dataset(name, config):  # stands in for datasets.load_dataset (no network here)
        calls.append((name, config))
        return {split: {"translation": rows} for split, rows in rows_by_split.items()}

    return load_dataset, calls


def test_hub_data_in_pair_direction_and_empty_sides_rejected(tmp_path):
    rows = [{"tr": f"kaynak {i}", "en": f"target {i}"} for i in range(4)]
    load, calls = _fake_wmt16({"train": rows, "validation": rows[:2], "test": rows[:3]})
    args = opus.parse_args(["--pair", "tr-en", "--out", str(tmp_path), "--max-train-samples", "3"])
    data = opus.load_pairs(args, load)
    assert calls == [("wmt16", "tr-en")]
    assert data["train"] == (["kaynak 0", "kaynak 1", "kaynak 2"], ["target 0", "target 1", "target 2"])
    assert len(data["valid"][0]) == 2 and len(data["test"][0]) == 3
    assert (args.model, args.ad_drop_p, args.ad_drop_q) == ("Helsinki-NLP/opus-mt-tr-en", 0.6, 0.1)

    bad = rows + [{"tr": "kaynak", "en": "  "}]
    load, _ = _fake_wmt16({"train": bad, "validation": rows, "test": rows})
    args = opus.parse_args(["--pair", "tr-en", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match=r"wmt16 tr-en train row 4: empty en side"):
        opus.load_pairs(args, load)
    args.drop_empty_pairs = True
    assert len(opus.load_pairs(args, load)["train"][0]) == 4


def test_any_opus_mt_pair_runs_with_its_model_and_wmt_config(tmp_path):
    rows = [{"en": f"source {i}", "tr": f"hedef {i}"} for i in range(3)]
    load, calls = _fake_wmt16({"train": rows, "validation": rows[:2], "test": rows})
    args = opus.parse_args(["--pair", "en-tr", "--out", str(tmp_path)])
    data = opus.load_pairs(args, load)
    assert calls == [("wmt16", "tr-en")]  # WMT names the pair English last, whichever the direction
    assert data["train"] == (["source 0", "source 1", "source 2"], ["hedef 0", "hedef 1", "hedef 2"])
    assert (args.model, args.ad_drop_p, args.ad_drop_q) == ("Helsinki-NLP/opus-mt-en-tr", 0.2, 0.2)

    args = opus.parse_args(["--pair", "de-fr", "--out", str(tmp_path), "--ad-drop-p", "0.4"])
    assert (args.model, args.dataset_config, args.ad_drop_p) == ("Helsinki-NLP/opus-mt-de-fr", "de-fr", 0.4)
    args = opus.parse_args(["--pair", "en-zle", "--out", str(tmp_path), "--dataset-config", "ru-en"])
    assert (args.model, args.src, args.tgt, args.dataset_config) == (
        "Helsinki-NLP/opus-mt-en-zle",
        "en",
        "zle",
        "ru-en",
    )


@pytest.mark.parametrize("pair", ["en_ro", "EN-RO", "en-en", "english-ro", "en-ro-de", "enro"])
def test_a_pair_not_of_the_form_src_tgt_is_refused(tmp_path, capsys, pair):
    with pytest.raises(SystemExit):
        opus.parse_args(["--pair", pair, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "argument --pair: must be SRC-TGT, two different lowercase 2- or 3-letter language codes" in err
    assert repr(pair) in err


def test_bad_options_fail_before_loading(tmp_path):
    def never(*a):
        raise AssertionError("data must not be loaded")

    with pytest.raises(ValueError, match=r"--ad-drop-q must be in the open interval \(0, 1\), got 0.0"):
        opus.main(["--pair", "en-ro", "--out", str(tmp_path), "--ad-drop-q", "0"], load_dataset=never)
    with pytest.raises(SystemExit):
        opus.main(["--pair", "en-ro", "--out", str(tmp_path), "--methods", "plain,rdrop"], load_dataset=never)


def test_t5_runs_through_the_same_runner_with_a_source_prefix(tmp_path):
    """T5 is a model name away: the runner with a tiny random T5 and the task prefix."""
    model_dir = tiny.build(
        tmp_path / "t5",
        CORPUS,
        "en",
        "ro",
        train_lines=400,
        vocab_size=300,
        d_model=32,
        layers=2,
        heads=4,
        ffn_dim=64,
        family="t5",
    )
    data = _slice(tmp_path / "data", {"train": 32, "valid": 8, "test": 6})
    out = tmp_path / "out"
    prefix = "translate English to Romanian: "
    assert (
        opus.main(
            [
                "--pair",
                "en-ro",
                "--out",
                str(out),
                "--model",
                str(model_dir),
                "--data-dir",
                str(data),
                "--epochs",
                "2",
                "--batch-size",
                "8",
                "--lr",
                "1e-3",
                "--num-beams",
                "1",
                "--max-new-tokens",
                "8",
                "--source-prefix",
                prefix,
                "--ad-drop-p",
                "0.3",
                "--ad-drop-q",
                "0.3",
            ]
        )
        == 0
    )
    results = {r["method"]: r for r in json.loads((out / "results.json").read_text())}
    ad = results["ad-drop"]["epochs"]
    assert ad[0]["ad_drop_on"] == 0 and ad[1]["ad_drop_on"] == 1 and 0 < ad[1]["ad_drop_rate"] < 0.3 * 0.3 + 0.05
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    src = (data / "train.en").read_text(encoding="utf-8").splitlines()[:2]
    batch = opus.tokenize(tok, (src, ["a", "b"]), 64, prefix)
    assert tok.decode(batch[0]["input_ids"], skip_special_tokens=True).startswith(prefix.strip())
    refs = (data / "test.ro").read_text(encoding="utf-8").splitlines()
    for r in results.values():
        hyps = (out / r["method"] / "test.hyp").read_text(encoding="utf-8").splitlines()
        assert r["bleu"] == round(sacrebleu.corpus_bleu(hyps, [refs]).score, 2)


def test_nllb_runs_through_the_same_runner_with_language_codes(tmp_path, monkeypatch):
    """NLLB is a model name away too: a tiny random M2M100 with an NllbTokenizer, --src/--tgt-lang-code.
    Inside the runner, each side of every training pair starts with its language code and generation
    starts with the target code."""
    model_dir = tiny.build(
        tmp_path / "nllb",
        CORPUS,
        "en",
        "ro",
        train_lines=400,
        vocab_size=300,
        d_model=32,
        layers=2,
        heads=4,
        ffn_dim=64,
        family="nllb",
    )
    data = _slice(tmp_path / "data", {"train": 32, "valid": 8, "test": 6})
    out = tmp_path / "out"
    first_tokens, generated = [], []
    real_tokenize, real_translate = opus.tokenize, opus.translate

    def tokenize(tokenizer, pairs, max_length, prefix=""):
        rows = real_tokenize(tokenizer, pairs, max_length, prefix)
        first_tokens.extend(tuple(tokenizer.convert_ids_to_tokens([r["input_ids"][0], r["labels"][0]])) for r in rows)
        return rows

    def translate(model, tokenizer, *args, **kwargs):
        real_generate = model.generate
        model.generate = lambda **kw: generated.append(real_generate(**kw)) or generated[-1]
        hyps = real_translate(model, tokenizer, *args, **kwargs)
        generated[:] = [tokenizer.convert_ids_to_tokens(g[:, 1].tolist()) for g in generated]
        return hyps

    monkeypatch.setattr(opus, "tokenize", tokenize)
    monkeypatch.setattr(opus, "translate", translate)
    assert (
        opus.main(
            [
                "--pair",
                "en-ro",
                "--out",
                str(out),
                "--model",
                str(model_dir),
                "--data-dir",
                str(data),
                "--epochs",
                "2",
                "--batch-size",
                "8",
                "--lr",
                "1e-3",
                "--num-beams",
                "1",
                "--max-new-tokens",
                "8",
                "--src-lang-code",
                "eng_Latn",
                "--tgt-lang-code",
                "ron_Latn",
                "--methods",
                "ad-drop",
                "--ad-drop-p",
                "0.3",
                "--ad-drop-q",
                "0.3",
            ]
        )
        == 0
    )
    (result,) = json.loads((out / "results.json").read_text())
    assert result["epochs"][1]["ad_drop_on"] == 1 and 0 < result["epochs"][1]["ad_drop_rate"] < 0.3 * 0.3 + 0.05
    assert first_tokens and set(first_tokens) == {("eng_Latn", "ron_Latn")}
    assert generated and all(set(tokens) == {"ron_Latn"} for tokens in generated)
    hyps = (out / "ad-drop" / "test.hyp").read_text(encoding="utf-8").splitlines()
    assert len(hyps) == 6 and result["bleu"] == round(
        sacrebleu.corpus_bleu(hyps, [(data / "test.ro").read_text(encoding="utf-8").splitlines()]).score, 2
    )
