"""examples/decoder_lm: the SFT script's own code path offline, on a tiny random Llama (with LoRA)."""

import json
import math

import pytest

from helpers import CORPUS, REPO, load_script, tiny_llama

sft = load_script(REPO / "examples" / "decoder_lm" / "sft.py", "decoder_lm_sft")
tiny = load_script(REPO / "examples" / "opus_mt" / "build_tiny_marian.py", "build_tiny_marian")


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    """A tiny random Llama with a sentencepiece tokenizer trained on the shipped corpus (pad 0, eos 1)."""
    import transformers

    path = tmp_path_factory.mktemp("tiny_lm")
    tiny.build(
        path,
        CORPUS,
        "en",
        "ro",
        train_lines=400,
        vocab_size=300,
        d_model=32,
        layers=1,
        heads=4,
        ffn_dim=64,
        family="t5",
    )  # for its tokenizer; the model is replaced below
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    tiny_llama(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    ).save_pretrained(path)
    return path


def test_encode_masks_the_prompt_and_ends_with_eos(tiny_lm):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_lm)
    (row,) = sft.encode(tok, ["Open file"], ["Deschide fișierul"], 64)
    prompt = tok(sft.PROMPT.format("Open file"), add_special_tokens=False)["input_ids"]
    assert row["input_ids"][: len(prompt)] == prompt and row["labels"][: len(prompt)] == [-100] * len(prompt)
    assert row["labels"][len(prompt) :] == row["input_ids"][len(prompt) :] and row["input_ids"][-1] == tok.eos_token_id


@pytest.mark.parametrize("lora", [0, 4])
def test_plain_and_ad_drop_sft_runs(tmp_path, tiny_lm, lora, capsys):
    if lora:
        pytest.importorskip("peft")
    out = tmp_path / "out"
    p, q = 0.3, 0.3
    assert (
        sft.main(
            [
                "--model",
                str(tiny_lm),
                "--out",
                str(out),
                "--max-train-samples",
                "24",
                "--max-eval-samples",
                "6",
                "--epochs",
                "2",
                "--batch-size",
                "8",
                "--lr",
                "1e-3",
                "--samples",
                "1",
                "--lora",
                str(lora),
                "--ad-drop-p",
                str(p),
                "--ad-drop-q",
                str(q),
            ]
        )
        == 0
    )
    results = {r["method"]: r for r in json.loads((out / "results.json").read_text())}
    assert list(results) == ["plain", "ad-drop"]
    ad = results["ad-drop"]["epochs"]
    assert ad[0]["ad_drop_on"] == 0 and ad[1]["ad_drop_on"] == 1 and 0.5 * p * q < ad[1]["ad_drop_rate"] < p * q + 0.05
    assert results["plain"]["epochs"][0]["train_loss"] == ad[0]["train_loss"]  # epoch 1 is plain in both
    assert "| ad-drop |" in capsys.readouterr().out


def test_bf16_gradient_checkpointing_and_max_length_reach_the_trainer(tmp_path, tiny_lm, monkeypatch):
    """The long-context options: bf16 autocast on the CPU, checkpointed layers, a token budget per example.

    At most 64 tokens: the blockwise kernel's lengths (>= 384) are the kernel tests' business."""
    trainers = []

    def recording(*args, **kwargs):
        trainers.append(sft_hf_trainer(*args, **kwargs))
        return trainers[-1]

    sft_hf_trainer = sft.hf_trainer
    monkeypatch.setattr(sft, "hf_trainer", recording)
    out, max_length = tmp_path / "out", 24
    argv = ["--model", str(tiny_lm), "--out", str(out), "--max-train-samples", "16", "--max-eval-samples", "4"]
    argv += ["--epochs", "1", "--batch-size", "8", "--lr", "1e-3", "--samples", "1", "--methods", "ad-drop"]
    argv += ["--ad-drop-schedule", "always", "--bf16", "--gradient-checkpointing", "--max-length", str(max_length)]
    assert sft.main(argv) == 0
    (trainer,) = trainers
    assert trainer.args.bf16 and trainer.accelerator.mixed_precision == "bf16"
    layers = [m for m in trainer.model.modules() if hasattr(m, "gradient_checkpointing")]
    assert layers and all(m.gradient_checkpointing for m in layers)
    lengths = [len(row["input_ids"]) for row in trainer.train_dataset]
    assert max(lengths) == max_length  # the corpus's instructions are longer: truncated to the budget
    (epoch,) = json.loads((out / "results.json").read_text())[0]["epochs"]
    assert epoch["ad_drop_on"] == 1 and epoch["ad_drop_rate"] > 0 and math.isfinite(epoch["train_loss"])


def test_bf16_and_fp16_together_are_refused(capsys):
    with pytest.raises(SystemExit):
        sft.parse_args(["--model", "m", "--out", "x", "--bf16", "--fp16"])  # before anything is loaded
    assert "argument --fp16: not allowed with argument --bf16" in capsys.readouterr().err
