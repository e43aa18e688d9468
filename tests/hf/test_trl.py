"""TRL's SFTTrainer with the plugin's trainer mixins: AD-DROP and AttendOut on a tiny Llama, padded,
padding-free and packed (TRL is the optional ``trl`` extra; these tests skip where it is absent)."""

import math

import pytest
import torch

from attn_reg_plugin.core import ADDropConfig, AttendOutConfig
from attn_reg_plugin.hf import ADDropTrainer, ADDropTrainerMixin, AttendOutTrainerMixin
from helpers import tiny_llama

WORDS = "the a cat dog sat ran on mat fast slow red blue big small one two three four".split()


@pytest.fixture(scope="module")
def trl():
    return pytest.importorskip("trl")


def word_tokenizer():
    """A word-level tokenizer over WORDS, built offline (pad 0, eos 1)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def prompt_completion(n=16, seed=0):
    """A prompt-completion dataset: TRL tokenizes it and masks the prompt (completion-only loss)."""
    import datasets

    g = torch.Generator().manual_seed(seed)

    def sentence(length):
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (length,), generator=g))

    return datasets.Dataset.from_list(
        [{"prompt": sentence(3 + i % 4) + " ", "completion": sentence(2 + i % 5)} for i in range(n)]
    )


def sft_model():
    return tiny_llama(vocab_size=len(WORDS) + 3, pad_token_id=0, eos_token_id=1, bos_token_id=None)


# padded (TRL's defaults: bf16 autocast and gradient checkpointing), padding-free, packed
LAYOUTS = {
    "padded": dict(),
    "padding_free": dict(padding_free=True, max_length=None, gradient_checkpointing=False, bf16=False),
    "packing": dict(packing=True, max_length=24, gradient_checkpointing=False, bf16=False),
}


def sft_config(trl, tmp_path, **layout):
    return trl.SFTConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=8,
        logging_steps=1,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,  # bf16 (TRL's default) on a CPU
        **layout,
    )


def trainer_classes(trl):
    class ADDropSFTTrainer(ADDropTrainerMixin, trl.SFTTrainer):
        pass

    class AttendOutSFTTrainer(AttendOutTrainerMixin, trl.SFTTrainer):
        pass

    return ADDropSFTTrainer, AttendOutSFTTrainer


def training_logs(trainer):
    return [r for r in trainer.state.log_history if "loss" in r]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sft_trainer_trains_with_ad_drop(trl, tmp_path, layout):
    ADDropSFTTrainer, _ = trainer_classes(trl)
    trainer = ADDropSFTTrainer(
        model=sft_model(),
        args=sft_config(trl, tmp_path, **LAYOUTS[layout]),
        train_dataset=prompt_completion(),
        processing_class=word_tokenizer(),
        ad_drop=ADDropConfig(p=0.3, q=0.3, schedule="always"),
    )
    batch = next(iter(trainer.get_train_dataloader()))
    assert ("position_ids" in batch) == (layout != "padded") and (batch["labels"] == -100).any()  # prompts masked
    trainer.train()
    logs = training_logs(trainer)
    assert len(logs) == 2
    for log in logs:
        assert log["ad_drop_on"] == 1 and 0.03 < log["ad_drop_rate"] < 0.3 and math.isfinite(log["loss"])
        assert log["num_tokens"] > 0  # TRL's own metrics still logged


@pytest.mark.parametrize("layout", ["padded", "padding_free"])
def test_sft_trainer_trains_with_attendout(trl, tmp_path, layout):
    _, AttendOutSFTTrainer = trainer_classes(trl)
    data = prompt_completion()
    trainer = AttendOutSFTTrainer(
        model=sft_model(),
        args=sft_config(trl, tmp_path, **LAYOUTS[layout]),
        train_dataset=data,
        eval_dataset=prompt_completion(8, seed=1),
        processing_class=word_tokenizer(),
        attendout=AttendOutConfig(dropout_step=1),
    )
    trainer.train()
    steps = [r for r in trainer.state.log_history if "attendout_dropout_step" in r]
    assert [r["attendout_dropout_step"] for r in steps] == [1, 2]
    assert all(0 < r["attendout_drop_rate"] < 1 for r in steps)
    # The Attacker runs its own layers (TRL wraps the model's forward on the instance): its loss is its own.
    logs = training_logs(trainer)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["attendout_attacker_loss"]) for r in logs)
    assert trainer.attendout_attacker.forward.__self__ is trainer.attendout_attacker
    # TRL's token count is the Defender's batches', as without AttendOut (the Attacker's step is not a second batch)
    tokens = sum(len(ids) for ids in trainer.train_dataset["input_ids"])  # two steps of 8: the whole set once
    logged = [r["num_tokens"] for r in trainer.state.log_history if "num_tokens" in r]  # TRL logs it once per step
    assert logged and logged[-1] == tokens


def test_sft_trainer_with_peft_config_and_with_scheduled_dropout(trl, tmp_path):
    """SFTTrainer wraps the model with peft after the mixin installed its sites: they stay on the
    modules peft wraps and only the adapters train. AttnRegTrainerMixin composes the same way."""
    peft = pytest.importorskip("peft")
    from attn_reg_plugin.core import ScheduledDropoutConfig
    from attn_reg_plugin.hf import AttnRegTrainerMixin

    ADDropSFTTrainer, _ = trainer_classes(trl)
    model = sft_model()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = ADDropSFTTrainer(
        model=model,
        args=sft_config(trl, tmp_path / "lora"),
        train_dataset=prompt_completion(),
        processing_class=word_tokenizer(),
        peft_config=peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        ad_drop=ADDropConfig(p=0.3, q=0.3, schedule="always"),
    )
    trainer.train()
    assert all(log["ad_drop_on"] == 1 and log["ad_drop_rate"] > 0.03 for log in training_logs(trainer))
    assert all(torch.equal(base[n], p) for n, p in model.named_parameters() if n in base)  # frozen base weights

    class AttnRegSFTTrainer(AttnRegTrainerMixin, trl.SFTTrainer):
        pass

    trainer = AttnRegSFTTrainer(
        model=sft_model(),
        args=sft_config(trl, tmp_path / "sched"),
        train_dataset=prompt_completion(),
        processing_class=word_tokenizer(),
        scheduled_dropout=ScheduledDropoutConfig(schedule="0:0.3"),
    )
    trainer.train()
    assert all(0.2 < log["attn_sched_dropout_rate"] < 0.4 for log in training_logs(trainer))


def test_padding_free_drops_per_document_and_at_the_padded_rate(trl, tmp_path):
    """The same documents padding-free (one row, position_ids restarting per document) and padded (one
    per row): the kernel's units are exactly the documents' own causal triangles, the AD-DROP rate is
    the padded batch's, and with nothing dropped the kernel's logits are the padded ones (no document
    sees another)."""
    from attn_reg_plugin.core.kernel.attention_call import EditScores

    ADDropSFTTrainer, _ = trainer_classes(trl)
    trainers = {
        name: ADDropSFTTrainer(
            model=sft_model(),
            args=sft_config(trl, tmp_path / name, **{**LAYOUTS[name], "gradient_checkpointing": False, "bf16": False}),
            train_dataset=prompt_completion(),
            processing_class=word_tokenizer(),
            ad_drop=ADDropConfig(p=0.3, q=0.3, schedule="always"),
        )
        for name in ("padded", "padding_free")
    }
    rows = [trainers["padded"].train_dataset[i] for i in range(6)]
    counts, logits = {}, {}
    for name, trainer in trainers.items():
        batch = trainer.data_collator([{k: r[k] for k in ("input_ids", "labels")} for r in rows])
        model = trainer.model.train()
        trainer.compute_loss(model, dict(batch))
        counts[name] = int(trainer._ad_drop_dropped), int(trainer._ad_drop_droppable)
        sites = trainer.ad_drop_controller.sites
        with torch.no_grad(), trainer.ad_drop_controller.hooks({s: EditScores() for s in sites}):
            out = model.eval()(**{k: v for k, v in batch.items() if k != "labels"}).logits
        real = batch["attention_mask"].bool() if "attention_mask" in batch else torch.ones(out.shape[:2], dtype=bool)
        logits[name] = out[real]
    lengths = torch.tensor([len(r["input_ids"]) for r in rows])
    heads_layers = 4 * 2  # tiny_llama
    dropped, valid = counts["padding_free"]
    assert valid == int((lengths * (lengths + 1) // 2).sum()) * heads_layers  # not one causal row's sum(L)^2 / 2
    rates = {name: d / v for name, (d, v) in counts.items()}  # padded: its padding queries count too, on both sides
    assert all(0.3 * 0.3 * 0.6 < r < 0.3 * 0.3 * 1.4 for r in rates.values()), rates
    torch.testing.assert_close(logits["padding_free"], logits["padded"], rtol=1e-4, atol=1e-4)


def test_a_model_given_by_name_is_refused_naming_the_fix(tmp_path):
    import transformers

    with pytest.raises(ValueError, match=r"needs the model object, not its name \('some/llama'\).*from_pretrained"):
        ADDropTrainer(
            model="some/llama",
            args=transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[]),
            ad_drop=ADDropConfig(p=0.3, q=0.3),
        )
