"""Each option is declared once, on its core config; the fairseq flags and the runners' argparse
options are generated from it (attn_reg_plugin.core.regularizers.options, fairseq_plugin.options)."""

import argparse
import dataclasses
import typing

import pytest

from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from attn_reg_plugin.core.regularizers.attendout import AttendOutConfig
from attn_reg_plugin.core.regularizers.hiddencut import HiddenCutConfig
from attn_reg_plugin.core.regularizers.layerdrop import AttentionLayerDropConfig
from attn_reg_plugin.core.regularizers.options import add_arguments, options_of
from attn_reg_plugin.core.regularizers.rdrop import RDropConfig
from attn_reg_plugin.core.regularizers.scheduled_dropout import ScheduledDropoutConfig
from helpers import REPO, controller_with_sites

pytestmark = pytest.mark.host_only  # no device branch: the portable run skips it

CONFIGS = [
    (ADDropConfig, "ad_drop_"),
    (AttendOutConfig, "attendout_"),
    (ScheduledDropoutConfig, "attn_sched_dropout_"),
    (AttentionLayerDropConfig, "attn_layerdrop_"),
    (RDropConfig, "rdrop_"),
    (HiddenCutConfig, "hiddencut_"),
]


def test_every_config_field_has_a_type_default_and_help():
    for config_cls, _ in CONFIGS:
        for opt in options_of(config_cls):
            # Optional[int] (AttendOutConfig.max_positions): unset (None) by default, an int when set
            kind = next((t for t in typing.get_args(opt.type) if t is not type(None)), opt.type)
            assert kind in (int, float, str, bool), (config_cls.__name__, opt)
            unset = opt.default is None and kind is not opt.type
            assert opt.help and (isinstance(opt.default, kind) or unset), (config_cls.__name__, opt)


@pytest.mark.parametrize("config_cls,prefix", CONFIGS)
def test_fairseq_flags_are_the_config_fields(config_cls, prefix):
    from attn_reg_plugin.fairseq_plugin.ad_drop_label_smoothed_cross_entropy import (
        ADDropLabelSmoothedCrossEntropyConfig,
    )
    from attn_reg_plugin.fairseq_plugin.ad_drop_sentence_prediction import ADDropSentencePredictionConfig
    from attn_reg_plugin.fairseq_plugin.attn_reg_sentence_prediction import AttnRegSentencePredictionConfig
    from attn_reg_plugin.fairseq_plugin.attn_reg_translation import AttnRegTranslationConfig
    from attn_reg_plugin.fairseq_plugin.hiddencut_label_smoothed_cross_entropy import (
        HiddenCutLabelSmoothedCrossEntropyConfig,
    )
    from attn_reg_plugin.fairseq_plugin.rdrop_label_smoothed_cross_entropy import RDropLabelSmoothedCrossEntropyConfig

    holders = {
        ADDropConfig: [ADDropLabelSmoothedCrossEntropyConfig, ADDropSentencePredictionConfig],
        RDropConfig: [RDropLabelSmoothedCrossEntropyConfig],
        HiddenCutConfig: [HiddenCutLabelSmoothedCrossEntropyConfig],
    }.get(config_cls, [AttnRegTranslationConfig, AttnRegSentencePredictionConfig])
    for holder in holders:
        fields = {f.name: f for f in dataclasses.fields(holder)}
        for opt in options_of(config_cls):
            f = fields[prefix + opt.name]
            assert (f.default, f.metadata["help"], f.type) == (opt.default, opt.help, opt.type), (holder.__name__, opt)
        # and nothing else under the prefix, except fairseq-only AttendOut settings
        extra = {n for n in fields if n.startswith(prefix)} - {prefix + o.name for o in options_of(config_cls)}
        assert extra <= {"attendout_clip_norm", "attendout_valid_subset", "attendout_log_file"}, extra


def test_fairseq_parser_reads_the_generated_flags(tiny_mt_data):
    from helpers import TINY_TRANSFORMER, fairseq_setup

    task = ["--task", "attn_reg_translation", *TINY_TRANSFORMER]
    criterion_flags = ["--criterion", "ad_drop_label_smoothed_cross_entropy", "--ad-drop-p", "0.4"]
    _, _, _, criterion = fairseq_setup(tiny_mt_data["bin"], [*task, *criterion_flags, "--ad-drop-iga-steps", "3"])
    assert criterion.ad_drop_config == ADDropConfig(p=0.4, iga_steps=3)  # every other field: the config default
    layerdrop = ["--criterion", "label_smoothed_cross_entropy", "--attn-layerdrop-p", "0.1"]
    cfg, _, _, _ = fairseq_setup(tiny_mt_data["bin"], [*task, *layerdrop, "--attn-layerdrop-layers", "1"])
    assert cfg.task.attn_layerdrop_layers == "1" and cfg.task.attendout_dropout_step == AttendOutConfig().dropout_step


def test_add_arguments_generates_runner_options():
    parser = argparse.ArgumentParser()
    add_arguments(parser, ADDropConfig, "--ad-drop-", only=("p", "iga_steps", "schedule"), defaults={"p": 0.3})
    actions = {a.dest: a for a in parser._actions}
    assert set(actions) == {"help", "ad_drop_p", "ad_drop_iga_steps", "ad_drop_schedule"}
    assert actions["ad_drop_p"].help.startswith(dict((o.name, o.help) for o in options_of(ADDropConfig))["p"])
    args = parser.parse_args(["--ad-drop-iga-steps", "4"])
    assert (args.ad_drop_p, args.ad_drop_iga_steps, args.ad_drop_schedule) == (0.3, 4, "cross-tuning")
    assert ADDropConfig.from_namespace(args) == ADDropConfig(p=0.3, iga_steps=4)
    with pytest.raises(SystemExit):
        parser.parse_args(["--ad-drop-iga-steps", "2.5"])  # typed as the field
    with pytest.raises(ValueError, match="ADDropConfig has no field 'rate'"):
        add_arguments(argparse.ArgumentParser(), ADDropConfig, "--ad-drop-", only=("rate",))


def test_docs_option_tables_are_generated_from_the_configs():
    from docs_tables import options_table, with_generated_tables

    doc = (REPO / "docs" / "OPTIONS.md").read_text(encoding="utf-8")
    assert with_generated_tables(doc) == doc, "run: .venv/bin/python tests/docs_tables.py docs/OPTIONS.md docs/HF.md"
    configs = (ADDropConfig, AttendOutConfig, ScheduledDropoutConfig, AttentionLayerDropConfig, RDropConfig)
    for config in (*configs, HiddenCutConfig):
        table = options_table(config)
        assert f"<!-- options: {config.__name__} -->\n{table}\n" in doc
        assert table.count("\n") == len(dataclasses.fields(config)) + 1  # header, rule, one row per field
    # the marker really regenerates: a stale row is replaced
    stale = doc.replace(
        "| `--ad-drop-q` | `ADDropConfig.q` | (0, 1) |", "| `--ad-drop-q` | `ADDropConfig.q` | (0, 2) |"
    )
    assert stale != doc and with_generated_tables(stale) == doc


def test_attention_auto_is_encoder_self_with_an_encoder_else_decoder_self(caplog):
    import logging

    from attn_reg_plugin.core.regularizers.ad_drop import ADDrop

    def controller(*kinds):
        return controller_with_sites({kind: 2 for kind in kinds})

    assert ADDropConfig().attention == "auto"
    with caplog.at_level(logging.INFO, logger="attn_reg_plugin.core.kernel.controller"):
        seq2seq = ADDrop(ADDropConfig(), controller("encoder-self", "decoder-self", "encoder-decoder"))
        decoder_only = ADDrop(ADDropConfig(), controller("decoder-self"))
    assert {s.kind for s in seq2seq.sites} == {"encoder-self"} and len(seq2seq.sites) == 2
    assert {s.kind for s in decoder_only.sites} == {"decoder-self"}
    assert [r.getMessage() for r in caplog.records] == [
        "--ad-drop-attention auto: encoder-self attention",
        "--ad-drop-attention auto: decoder-self attention",
    ]
    with pytest.raises(ValueError, match=r"--ad-drop-attention: 'auto' stands alone; got 'auto,encoder-self'"):
        ADDropConfig(attention="auto,encoder-self").validate()
