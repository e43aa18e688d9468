"""Every wrong option value is refused before training, with the message docs/OPTIONS.md lists.

One table per regularizer: a row is (field, value on the fairseq command line, value in the
Python config, message). ``{opt}`` in the message is the option as the user spelled it: the
fairseq flag (``--ad-drop-p``) or the config field (``ADDropConfig.p``). Each row is tried
through fairseq's own parsing and task/criterion set-up (what fairseq-train does before it
reads data) and through the Hugging Face trainer's construction; the formatted fairseq
message must also appear verbatim in the "Bad input" table of docs/OPTIONS.md. A regularizer adds
its table to REGULARIZERS.
"""

import math
import re
from dataclasses import dataclass, fields
from typing import Callable, List, Optional

import pytest

from helpers import REPO, TINY_TRANSFORMER, fairseq_setup, fairseq_train

try:  # registers --criterion hiddencut_label_smoothed_cross_entropy (under the user dir's package path)
    import attn_reg_plugin.fairseq_plugin.hiddencut_label_smoothed_cross_entropy  # noqa: F401
except ImportError:  # no fairseq: its tests skip
    pass

INTERVAL = "{opt} must be in the open interval (0, 1), got {got}"
KINDS = "encoder-self, decoder-self, encoder-decoder"


@dataclass
class Bad:
    field: str
    cli: Optional[str]  # None: not expressible on the command line
    py: object  # _SAME: the CLI string
    message: str  # {opt} is the option's name
    got_cli: Optional[str] = None  # how the parsed CLI value prints, where it differs from repr(py)
    python: bool = True  # False: a fairseq-only option (no config field)


_SAME = object()

AD_DROP_BAD: List[Bad] = [
    Bad("p", "1.5", 1.5, INTERVAL.format(opt="{opt}", got="1.5")),
    Bad("p", "0", 0, INTERVAL.format(opt="{opt}", got="{got}"), got_cli="0.0"),
    Bad("p", "1", 1.0, INTERVAL.format(opt="{opt}", got="1.0")),
    Bad("p", "-0.1", -0.1, INTERVAL.format(opt="{opt}", got="-0.1")),
    Bad("p", "nan", math.nan, INTERVAL.format(opt="{opt}", got="nan")),
    Bad("p", None, "0.5", "{opt} must be an int or float in the open interval (0, 1), got '0.5'"),
    Bad("p", None, None, "{opt} must be an int or float in the open interval (0, 1), got None"),
    Bad(
        "p",
        "1e-300",
        1e-300,
        "{opt}: p = 1e-300 has more than 18 decimal places; the candidate count ceil(p * n) is computed exactly for "
        "decimals up to that",
    ),
    Bad("q", "0", 0, INTERVAL.format(opt="{opt}", got="{got}"), got_cli="0.0"),
    Bad("q", "1.0", 1.0, INTERVAL.format(opt="{opt}", got="1.0")),
    Bad("q", "inf", math.inf, INTERVAL.format(opt="{opt}", got="inf")),
    Bad(
        "layers",
        "0,7",
        _SAME,
        "{opt}: layer 7 does not exist; the model's encoder-self attention has 2 layers, so accepted indices are 0..1",
    ),
    Bad("layers", "-1", _SAME, "{opt}: layer indices are 0-based and >= 0, got [-1]"),
    Bad(
        "layers", "first", _SAME, "{opt} must be 'all' or a comma-separated list of 0-based layer indices, got 'first'"
    ),
    Bad("layers", ",", _SAME, "{opt} must name at least one layer, got ','"),
    Bad("attention", "cross", _SAME, "{opt}: unknown attention kind 'cross'; accepted: " + KINDS),
    Bad("attention", ",", _SAME, "{opt} must name at least one of " + KINDS),
    Bad("attribution", "shap", _SAME, "{opt} must be one of ga, iga, aa, rd, got 'shap'"),
    Bad("iga_steps", "0", 0, "{opt} must be an integer >= 1, got 0"),
    Bad("iga_steps", None, 2.5, "{opt} must be an integer >= 1, got 2.5"),
    Bad("iga_steps", None, True, "{opt} must be an integer >= 1, got True"),
    Bad("labels", "silver", _SAME, "{opt} must be one of pseudo, gold, got 'silver'"),
    Bad("schedule", "odd", _SAME, "{opt} must be one of cross-tuning, always, got 'odd'"),
    Bad("region", "middle", _SAME, "{opt} must be one of top, bottom, got 'middle'"),
    Bad("attribution_precision", "fp16", _SAME, "{opt} must be one of auto, fp32, bf16, got 'fp16'"),
]

# Values argparse refuses by type before any plugin code runs (fairseq only).
AD_DROP_BAD_TYPES = [
    ("--ad-drop-p", "abc", "argument --ad-drop-p: invalid float value: 'abc'"),
    ("--ad-drop-q", "half", "argument --ad-drop-q: invalid float value: 'half'"),
    ("--ad-drop-iga-steps", "2.5", "argument --ad-drop-iga-steps: invalid int value: '2.5'"),
]


FINITE_POSITIVE = "{opt} must be a finite number > 0, got {got}"
INTEGER = "{opt} must be an integer >= 1, got {got}"
NO_LAYER_7 = (
    "{opt}: layer 7 does not exist; the model's encoder-self attention has 2 layers, so accepted indices are 0..1"
)
UNKNOWN_KIND = "{opt}: unknown attention kind 'cross'; accepted: " + KINDS

ATTENDOUT_BAD: List[Bad] = [
    Bad("dropout_step", "0", 0, INTEGER),
    Bad("dropout_step", "-3", -3, INTEGER),
    Bad("dropout_step", None, 2.5, INTEGER),
    Bad("dropout_step", None, True, INTEGER),
    Bad("generator_dim", "0", 0, INTEGER),
    Bad("max_positions", "0", 0, INTEGER),
    Bad("lr", "0", 0.0, FINITE_POSITIVE, got_cli="0.0"),
    Bad("lr", "-1e-3", -1e-3, FINITE_POSITIVE, got_cli="-0.001"),
    Bad("lr", "inf", math.inf, FINITE_POSITIVE),
    Bad("temperature", "0", 0.0, FINITE_POSITIVE, got_cli="0.0"),
    Bad("temperature", "-1", -1.0, FINITE_POSITIVE, got_cli="-1.0"),
    Bad("temperature", "nan", math.nan, FINITE_POSITIVE),
    Bad("baseline_decay", "1", 1.0, "{opt} must be in [0, 1), got {got}", got_cli="1.0"),
    Bad("baseline_decay", "-0.5", -0.5, "{opt} must be in [0, 1), got {got}"),
    Bad("init_drop", "0", 0.0, "{opt} must be in the open interval (0, 1), got {got}", got_cli="0.0"),
    Bad("init_drop", "1.2", 1.2, "{opt} must be in the open interval (0, 1), got {got}"),
    Bad("layers", "0,7", _SAME, NO_LAYER_7),
    Bad(
        "layers", "first", _SAME, "{opt} must be 'all' or a comma-separated list of 0-based layer indices, got 'first'"
    ),
    Bad("attention", "cross", _SAME, UNKNOWN_KIND),
    Bad("clip_norm", "-1", None, "{opt} must be a finite number >= 0, got -1.0", python=False),
    Bad("clip_norm", "nan", None, "{opt} must be a finite number >= 0, got nan", python=False),
]
ATTENDOUT_BAD_TYPES = [
    ("--attendout-dropout-step", "2.5", "argument --attendout-dropout-step: invalid int value: '2.5'"),
    ("--attendout-temperature", "warm", "argument --attendout-temperature: invalid float value: 'warm'"),
]

SCHED_DROPOUT_BAD: List[Bad] = [
    Bad("schedule", "0:1.5", _SAME, "{opt}: knot '0:1.5' probability must be a probability in [0, 1], got 1.5"),
    Bad(
        "schedule",
        "0:0.3,100:-0.1",
        _SAME,
        "{opt}: knot '100:-0.1' probability must be a probability in [0, 1], got -0.1",
    ),
    Bad("schedule", "abc", _SAME, "{opt}: cannot read knot 'abc'; expected UPDATE:PROB such as 0:0.6"),
    Bad("schedule", "0:0.3:1", _SAME, "{opt}: cannot read knot '0:0.3:1'; expected UPDATE:PROB such as 0:0.6"),
    Bad("schedule", "-1:0.3", _SAME, "{opt}: knot updates must be integers >= 0, got '-1'"),
    Bad("schedule", "0.5:0.3", _SAME, "{opt}: knot updates must be integers >= 0, got '0.5'"),
    Bad("schedule", "nan:0.3", _SAME, "{opt}: knot updates must be integers >= 0, got 'nan'"),
    Bad("schedule", "0:0.3,1e400:0.1", _SAME, "{opt}: knot updates must be integers >= 0, got '1e400'"),
    # float() reads these too: other scripts' digits, an underscore, an integer past float's exact range
    Bad("schedule", "\u0661:0.3", _SAME, "{opt}: knot updates must be integers >= 0, got '\u0661'"),
    Bad("schedule", "1_000:0.3", _SAME, "{opt}: knot updates must be integers >= 0, got '1_000'"),
    Bad("schedule", "0:0.3,1e17:0.1", _SAME, "{opt}: knot updates must be integers >= 0, got '1e17'"),
    Bad("schedule", "5:0.3,2:0.1", _SAME, "{opt}: knot updates must increase strictly, got 5 then 2"),
    Bad(
        "schedule",
        "0:0.3|0:0.2|0:0.1",
        _SAME,
        "{opt} gives 3 schedules separated by '|', but 2 layers are selected "
        "([0, 1]): give one schedule, or one per layer",
    ),
    Bad("schedule", None, "", "{opt} is empty: scheduled attention dropout is off"),
    Bad("schedule", "dropkey:1", _SAME, "{opt}: DropKey's rate must be a number in [0, 1), got 1.0"),
    Bad("schedule", "dropkey:-0.1", _SAME, "{opt}: DropKey's rate must be a number in [0, 1), got -0.1"),
    Bad(
        "schedule", "dropkey:abc", _SAME, "{opt}: cannot read 'dropkey:abc'; expected dropkey:RATE such as dropkey:0.1"
    ),
    Bad("layers", "0,7", _SAME, NO_LAYER_7),
    Bad("attention", "cross", _SAME, UNKNOWN_KIND),
]

LAYERDROP_BAD: List[Bad] = [
    Bad("p", "1.5", 1.5, "{opt} must be a probability in [0, 1], got 1.5"),
    Bad("p", "-0.1", -0.1, "{opt} must be a probability in [0, 1], got -0.1"),
    Bad("p", "nan", math.nan, "{opt} must be a probability in [0, 1], got nan"),
    Bad("p", None, "0.5", "{opt} must be a probability in [0, 1], got '0.5'"),
    Bad("layers", "0,7", _SAME, NO_LAYER_7),
    Bad("layers", "-1", _SAME, "{opt}: layer indices are 0-based and >= 0, got [-1]"),
    Bad("attention", "cross", _SAME, UNKNOWN_KIND),
]
LAYERDROP_BAD_TYPES = [("--attn-layerdrop-p", "x", "argument --attn-layerdrop-p: invalid float value: 'x'")]

NON_NEGATIVE = "{opt} must be a finite number >= 0, got {got}"
RDROP_BAD: List[Bad] = [
    Bad("alpha", "-1", -1.0, NON_NEGATIVE),
    Bad("alpha", "nan", math.nan, NON_NEGATIVE),
    Bad("alpha", "inf", math.inf, NON_NEGATIVE),
    Bad("alpha", None, "5", NON_NEGATIVE),
    Bad("concat_batch", None, "yes", "{opt} must be True or False, got {got}"),
]
RDROP_BAD_TYPES = [("--rdrop-alpha", "x", "argument --rdrop-alpha: invalid float value: 'x'")]

FRACTION = "{opt} must be a fraction in (0, 1], got {got}"
HIDDENCUT_BAD: List[Bad] = [
    Bad("ratio", "0", 0, FRACTION, got_cli="0.0"),
    Bad("ratio", "1.5", 1.5, FRACTION),
    Bad("ratio", "nan", math.nan, FRACTION),
    Bad("ratio", None, "0.1", FRACTION),
    Bad("top", "-0.4", -0.4, FRACTION),
    Bad("top", None, True, FRACTION),
    Bad("alpha", "-1", -1.0, NON_NEGATIVE),
    Bad("alpha", "inf", math.inf, NON_NEGATIVE),
    Bad("layers", "-1", _SAME, "{opt}: layer indices are 0-based and >= 0, got [-1]"),
    Bad(
        "layers", "first", _SAME, "{opt} must be 'all' or a comma-separated list of 0-based layer indices, got 'first'"
    ),
    # past the model's layers: the trainer knows the model at construction, fairseq's criterion when it is built
    # (tests/fairseq/test_fairseq_hiddencut.py checks fairseq's message, which says "encoder layers")
    Bad("layers", None, "5", "{opt}: the model has 2 layers (0-1), got 5"),
]
HIDDENCUT_BAD_TYPES = [("--hiddencut-ratio", "x", "argument --hiddencut-ratio: invalid float value: 'x'")]


@dataclass
class Regularizer:
    name: str
    table: List[Bad]
    type_errors: list
    fairseq_args: List[str]  # criterion and options that make a valid run
    flag: Callable[[str], str]  # field -> fairseq flag
    hf_field: Callable[[str], str]  # field -> name in HF messages
    hf_trainer: Callable  # (model, args, config fields) -> constructs the trainer
    config_class: type  # every field of it must have a row in docs/OPTIONS.md


def _ad_drop_trainer(model, args, fields):
    from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
    from attn_reg_plugin.hf import ADDropTrainer

    return ADDropTrainer(model=model, args=args, ad_drop=ADDropConfig(**fields))


def _eval_dataset():
    return [{"input_ids": [2, 5, 7, 3], "labels": 1}, {"input_ids": [2, 9, 3], "labels": 0}]


def _attendout_trainer(model, args, fields):
    from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig
    from attn_reg_plugin.hf import AttendOutTrainer

    return AttendOutTrainer(model=model, args=args, eval_dataset=_eval_dataset(), attendout=AttendOutConfig(**fields))


def _sched_dropout_trainer(model, args, fields):
    from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledDropoutConfig
    from attn_reg_plugin.hf import AttnRegTrainer

    return AttnRegTrainer(
        model=model, args=args, scheduled_dropout=ScheduledDropoutConfig(**{"schedule": "0:0.3", **fields})
    )


def _layerdrop_trainer(model, args, fields):
    from attn_reg_plugin.core.regularizers.layerdrop import AttentionLayerDropConfig
    from attn_reg_plugin.hf import AttnRegTrainer

    return AttnRegTrainer(model=model, args=args, layerdrop=AttentionLayerDropConfig(**{"p": 0.2, **fields}))


def _rdrop_trainer(model, args, fields):
    from attn_reg_plugin.core.regularizers.rdrop import RDropConfig
    from attn_reg_plugin.hf import RDropTrainer

    return RDropTrainer(model=model, args=args, rdrop=RDropConfig(**fields))


def _hiddencut_trainer(model, args, fields):
    from attn_reg_plugin.core.regularizers.hiddencut import HiddenCutConfig
    from attn_reg_plugin.hf.hiddencut_trainer import HiddenCutTrainer

    return HiddenCutTrainer(model=model, args=args, hiddencut=HiddenCutConfig(**fields))


def _config_class(module, name):
    import importlib

    return getattr(importlib.import_module(f"attn_reg_plugin.core.regularizers.{module}"), name)


def _prefixed(prefix):
    return lambda field: prefix + field.replace("_", "-")


PLAIN_CRITERION = ["--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1"]

REGULARIZERS = [
    Regularizer(
        "ad_drop",
        AD_DROP_BAD,
        AD_DROP_BAD_TYPES,
        ["--criterion", "ad_drop_label_smoothed_cross_entropy", "--label-smoothing", "0.1"],
        _prefixed("--ad-drop-"),
        lambda field: f"ADDropConfig.{field}",
        _ad_drop_trainer,
        _config_class("ad_drop", "ADDropConfig"),
    ),
    Regularizer(
        "attendout",
        ATTENDOUT_BAD,
        ATTENDOUT_BAD_TYPES,
        [*PLAIN_CRITERION, "--attendout"],
        _prefixed("--attendout-"),
        lambda field: f"AttendOutConfig.{field}",
        _attendout_trainer,
        _config_class("attendout", "AttendOutConfig"),
    ),
    Regularizer(
        "sched_dropout",
        SCHED_DROPOUT_BAD,
        [],
        [*PLAIN_CRITERION, "--attn-sched-dropout-schedule", "0:0.3,100:0.1"],
        _prefixed("--attn-sched-dropout-"),
        lambda field: f"ScheduledDropoutConfig.{field}",
        _sched_dropout_trainer,
        _config_class("scheduled_dropout", "ScheduledDropoutConfig"),
    ),
    Regularizer(
        "layerdrop",
        LAYERDROP_BAD,
        LAYERDROP_BAD_TYPES,
        [*PLAIN_CRITERION, "--attn-layerdrop-p", "0.2"],
        _prefixed("--attn-layerdrop-"),
        lambda field: f"AttentionLayerDropConfig.{field}",
        _layerdrop_trainer,
        _config_class("layerdrop", "AttentionLayerDropConfig"),
    ),
    Regularizer(
        "rdrop",
        RDROP_BAD,
        RDROP_BAD_TYPES,
        ["--criterion", "rdrop_label_smoothed_cross_entropy", "--label-smoothing", "0.1"],
        _prefixed("--rdrop-"),
        lambda field: f"RDropConfig.{field}",
        _rdrop_trainer,
        _config_class("rdrop", "RDropConfig"),
    ),
    Regularizer(
        "hiddencut",
        HIDDENCUT_BAD,
        HIDDENCUT_BAD_TYPES,
        ["--criterion", "hiddencut_label_smoothed_cross_entropy", "--label-smoothing", "0.1"],
        _prefixed("--hiddencut-"),
        lambda field: f"HiddenCutConfig.{field}",
        _hiddencut_trainer,
        _config_class("hiddencut", "HiddenCutConfig"),
    ),
]


def _rows(kind):
    for reg in REGULARIZERS:
        for row in reg.table:
            if (kind == "cli" and row.cli is None) or (kind == "py" and not row.python):
                continue
            value = row.cli if kind == "cli" or row.py is _SAME else repr(row.py)  # ids the same in every process
            yield pytest.param(reg, row, id=f"{reg.name}-{row.field}={value}")


def _cli_message(reg, row):
    got = row.got_cli if row.got_cli is not None else (row.cli if row.py is _SAME else repr(row.py))
    return row.message.format(opt=reg.flag(row.field), got=got)


def _setup(tiny_mt_data, reg, *extra):
    return fairseq_setup(
        tiny_mt_data["bin"], ["--task", "attn_reg_translation", *TINY_TRANSFORMER, *reg.fairseq_args, *extra]
    )


# -- fairseq: the flags, through fairseq's parser and task / model / criterion set-up --------------
@pytest.mark.parametrize("reg, row", _rows("cli"))
def test_fairseq_refuses_bad_value_while_building(tiny_mt_data, reg, row):
    with pytest.raises(ValueError) as e:
        _setup(tiny_mt_data, reg, f"{reg.flag(row.field)}={row.cli}")
    assert str(e.value) == _cli_message(reg, row)


@pytest.mark.parametrize(
    "reg, flag, value, message",
    [pytest.param(r, *t, id=f"{r.name}{t[0]}={t[1]}") for r in REGULARIZERS for t in r.type_errors],
)
def test_fairseq_parser_refuses_wrong_type(tiny_mt_data, capsys, reg, flag, value, message):
    with pytest.raises(SystemExit) as e:
        _setup(tiny_mt_data, reg, f"{flag}={value}")
    assert e.value.code == 2
    assert "error: " + message in capsys.readouterr().err


@pytest.mark.parametrize("reg", REGULARIZERS, ids=lambda r: r.name)
def test_fairseq_valid_options_build(tiny_mt_data, reg):
    """The same set-up with the defaults succeeds: the rows above fail because of their value."""
    _, task, _, criterion = _setup(tiny_mt_data, reg)
    built = {
        "ad_drop": getattr(criterion, "ad_drop", None),
        "attendout": task.attn_reg_attendout,
        "sched_dropout": task.attn_reg_active.get("scheduled_dropout"),
        "layerdrop": task.attn_reg_active.get("layerdrop"),
        "rdrop": getattr(criterion, "rdrop_config", None),
        "hiddencut": getattr(criterion, "hiddencut_config", None),
    }
    assert [name for name, regularizer in built.items() if regularizer is not None] == [reg.name]


def test_fairseq_ad_drop_criterion_needs_an_attn_reg_task(tiny_mt_data):
    with pytest.raises(ValueError) as e:
        fairseq_setup(tiny_mt_data["bin"], ["--task", "translation", *TINY_TRANSFORMER, *REGULARIZERS[0].fairseq_args])
    assert str(e.value) == (
        "the ad_drop criterions need an attn_reg task, which routes attention through the plugin "
        "(--task attn_reg_translation); got TranslationTask"
    )


def test_fairseq_train_stops_before_training(tiny_mt_data, tmp_path):
    """The real CLI: a bad value ends fairseq-train before the first epoch and writes nothing."""
    proc = fairseq_train(
        tiny_mt_data["bin"],
        [
            "--save-dir",
            tmp_path,
            "--cpu",
            "--task",
            "attn_reg_translation",
            *TINY_TRANSFORMER,
            *REGULARIZERS[0].fairseq_args,
            "--optimizer",
            "adam",
            "--max-tokens",
            "500",
            "--max-epoch",
            "1",
            "--ad-drop-layers",
            "0,7",
        ],
        expect_ok=False,
    )
    assert proc.returncode != 0
    assert (
        "ValueError: --ad-drop-layers: layer 7 does not exist; the model's encoder-self attention has 2 layers, "
        "so accepted indices are 0..1"
    ) in proc.stdout
    assert "begin training epoch" not in proc.stdout and not re.search(r"loaded \d+ examples", proc.stdout)
    assert not list(tmp_path.glob("*.pt"))


# -- Hugging Face: the same values as config fields, at trainer construction ----------------------
@pytest.fixture(scope="module")
def hf_model_and_args(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=50,
        attn_implementation="sdpa",
    )
    model = transformers.BertForSequenceClassification(config)
    args = transformers.TrainingArguments(output_dir=str(tmp_path_factory.mktemp("hf")), use_cpu=True, report_to=[])
    return model, args


@pytest.mark.parametrize("reg, row", _rows("py"))
def test_hf_trainer_refuses_bad_value_at_construction(hf_model_and_args, reg, row):
    value = row.cli if row.py is _SAME else row.py
    with pytest.raises(ValueError) as e:
        reg.hf_trainer(*hf_model_and_args, {row.field: value})
    assert str(e.value) == row.message.format(opt=reg.hf_field(row.field), got=repr(value))


def test_hf_trainer_refuses_attention_the_model_lacks(hf_model_and_args):
    with pytest.raises(ValueError) as e:
        REGULARIZERS[0].hf_trainer(*hf_model_and_args, {"attention": "encoder-self,encoder-decoder"})
    assert str(e.value) == (
        "ADDropConfig.attention: attention kind 'encoder-decoder' was asked for, but this model "
        "has no such attention (it has: encoder-self)"
    )


def test_hf_trainer_refuses_a_non_config(hf_model_and_args):
    from attn_reg_plugin.hf import ADDropTrainer

    with pytest.raises(TypeError, match=r"^ad_drop must be an ADDropConfig, got dict$"):
        ADDropTrainer(model=hf_model_and_args[0], args=hf_model_and_args[1], ad_drop={"p": 0.2})


# -- docs/OPTIONS.md lists exactly these messages ----------------------------------------------
def test_docs_bad_input_table_lists_every_message():
    options = (REPO / "docs" / "OPTIONS.md").read_text(encoding="utf-8")
    section = options[options.index("\n## Bad input") :]
    end = section.find("\n## ", 1)  # the section runs to the next heading of its level, or to the end
    section = (section if end < 0 else section[:end]).replace("\\|", "|")  # '|' is escaped in table cells
    for reg in REGULARIZERS:
        for row in reg.table:
            if row.cli is not None:
                assert _cli_message(reg, row) in section, _cli_message(reg, row)
            else:  # Python-only rows: the message with the config field's name (values may share a row)
                message = row.message.format(opt=reg.hf_field(row.field), got=repr(row.py)).split(", got ")[0]
                assert message in section and repr(row.py) in section, (message, row.py)
            assert reg.flag(row.field) in section, reg.flag(row.field)
        for _, _, message in reg.type_errors:
            assert message in section, message
        # Every option of the config is in the table, named both ways on one line.
        for f in fields(reg.config_class):
            flag, py = re.escape(reg.flag(f.name)), re.escape(reg.hf_field(f.name))
            assert re.search(rf"`{flag}`.*`{py}`", section), (reg.name, f.name)
