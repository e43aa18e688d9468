"""End to end through the real fairseq CLIs on tiny data: preprocess -> train -> generate."""
import re

import pytest
import torch

pytest.importorskip("fairseq")

from helpers import REPO, PLUGIN_DIR, TINY_TRANSFORMER, run_cli, train_epoch_stats  # noqa: E402

AD_DROP = ["--task", "attn_reg_translation", *TINY_TRANSFORMER,
           "--criterion", "ad_drop_label_smoothed_cross_entropy", "--label-smoothing", "0.1",
           "--ad-drop-p", "0.3", "--ad-drop-q", "0.5", "--ad-drop-attention", "encoder-self,decoder-self,encoder-decoder",
           "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--cpu", "--seed", "3",
           "--no-progress-bar", "--log-format", "simple", "--log-interval", "1", "--no-epoch-checkpoints"]


def test_train_cross_tuning_generate_and_resume(tiny_mt_data, tmp_path):
    save = tmp_path / "ckpt"
    first = run_cli("fairseq-train", [tiny_mt_data["bin"], "--user-dir", PLUGIN_DIR, "--save-dir", save,
                                      *AD_DROP, "--max-epoch", "2"])
    stats = train_epoch_stats(first.stdout)
    assert set(stats) == {1, 2}
    assert stats[1]["ad_drop_on"] == "0" and stats[1]["ad_drop_rate"] == "0"  # odd epoch: plain, nothing dropped
    assert stats[2]["ad_drop_on"] == "1"  # even epoch: AD-DROP
    rate = float(stats[2]["ad_drop_rate"])
    assert 0.5 * 0.3 * 0.5 < rate < 0.3 * 0.5 * 2.5, rate  # about p*q (ceil(p*n) inflates short rows)
    assert "nan" not in first.stdout.lower().replace("nan_", "")

    # Resume from checkpoint_last: epoch 3 continues the count and is a plain epoch again.
    second = run_cli("fairseq-train", [tiny_mt_data["bin"], "--user-dir", PLUGIN_DIR, "--save-dir", save,
                                       *AD_DROP, "--max-epoch", "3"])
    assert re.search(r"Loaded checkpoint .*checkpoint_last\.pt \(epoch 3 @ [1-9]\d* updates\)", second.stdout)
    stats = train_epoch_stats(second.stdout)
    assert set(stats) == {3} and stats[3]["ad_drop_on"] == "0" and stats[3]["ad_drop_rate"] == "0"

    # The checkpoint is a plain fairseq checkpoint that loads with torch's safe unpickler once
    # the plugin is imported (it allow-lists the one class fairseq pickles).
    import attn_reg_plugin.fairseq_plugin  # noqa: F401

    state = torch.load(save / "checkpoint_last.pt", weights_only=True)
    assert "encoder.layers.0.self_attn.q_proj.weight" in state["model"]

    gen = run_cli("fairseq-generate", [tiny_mt_data["bin"], "--user-dir", PLUGIN_DIR, "--path", save / "checkpoint_last.pt",
                                       "--scoring", "sacrebleu", "--required-batch-size-multiple", "1", "--cpu",
                                       "--beam", "2", "--max-len-b", "20", "--remove-bpe", "sentencepiece"])
    assert re.search(r"Generate test with beam=2: BLEU = \d+\.\d+", gen.stdout)
    assert len(re.findall(r"^D-\d+\t", gen.stdout, flags=re.M)) == 40  # no sentence lost


# The two fairseq-hydra-train recipes of examples/hydra, shrunk to the tiny model and data on the
# command line (the yaml's own settings are the WMT16-sized ones).
# ("++": the arch's fields join the config only once fairseq merges its dataclass.)
HYDRA_TINY = [
    "++model.encoder_layers=2", "++model.decoder_layers=2", "++model.encoder_embed_dim=16",
    "++model.decoder_embed_dim=16", "++model.encoder_ffn_embed_dim=32", "++model.decoder_ffn_embed_dim=32",
    "++model.encoder_attention_heads=2", "++model.decoder_attention_heads=2", "common.fp16=false", "common.cpu=true", "common.log_interval=1",
    "common.seed=3", "dataset.max_tokens=500", "optimization.max_update=4", "checkpoint.no_save=true",
]


@pytest.mark.parametrize("recipe,key", [("ad_drop_transformer", "ad_drop_rate"),
                                        ("attendout_transformer", "attendout_attacker_loss")])
def test_hydra_recipes_train(tiny_mt_data, tmp_path, recipe, key):
    proc = run_cli("fairseq-hydra-train", [
        "--config-dir", REPO / "examples" / "hydra", "--config-name", recipe, f"task.data={tiny_mt_data['bin']}",
        f"common.user_dir={PLUGIN_DIR}", f"checkpoint.save_dir={tmp_path / 'ckpt'}", f"hydra.run.dir={tmp_path}",
        "task.attendout_dropout_step=2" if recipe.startswith("attendout") else "criterion.ad_drop_schedule=always",
        *HYDRA_TINY], cwd=tmp_path)
    updates = re.findall(r"\[train_inner\]\[INFO\] - (\{.*\})", proc.stdout)  # hydra's log format
    assert len(updates) == 4, proc.stdout[-3000:]
    assert all(f'"{key}"' in u for u in updates)
    if recipe.startswith("attendout"):
        assert "AttendOut dropout step 2 (update 4)" in proc.stdout
