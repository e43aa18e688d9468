"""core.controller: registering sites, selecting them by kind and layer, and hooks restored on error."""

import pytest

from attn_reg_plugin.core.kernel.attention_call import hook_in_progress
from attn_reg_plugin.core.kernel.controller import RegularizationController, parse_kinds, parse_layers
from attn_reg_plugin.core.regularizers.ad_drop import ADDrop
from attn_reg_plugin.core.regularizers.ad_drop_config import ADDropConfig
from helpers import controller_with_sites

pytestmark = pytest.mark.host_only  # no device branch: the portable run skips it


def _controller(n_enc=2, n_dec=0):
    return controller_with_sites({"encoder-self": n_enc, "decoder-self": n_dec})


def test_select_returns_requested_sites():
    c = _controller(3, 2)
    assert [(s.kind, s.layer) for s in c.select(["encoder-self"], None)] == [("encoder-self", i) for i in range(3)]
    assert [(s.kind, s.layer) for s in c.select(["encoder-self", "decoder-self"], [1])] == [
        ("encoder-self", 1),
        ("decoder-self", 1),
    ]


def test_select_layer_out_of_range_names_the_range():
    c = _controller(2)
    with pytest.raises(ValueError) as e:
        c.select(["encoder-self"], [0, 2], option="--ad-drop-layers")
    msg = str(e.value)
    assert "--ad-drop-layers" in msg and "layer 2" in msg and "0..1" in msg and "2 layers" in msg


def test_select_missing_kind_raises():
    c = _controller(2)
    with pytest.raises(ValueError, match="decoder-self.*it has: encoder-self"):
        c.select(["decoder-self"], None)
    with pytest.raises(ValueError, match="it has: none"):
        RegularizationController().select(["encoder-self"], None)


def test_register_unknown_kind_raises():
    with pytest.raises(ValueError, match="cross"):
        RegularizationController().register("cross", 0)


def test_parse_layers():
    assert parse_layers("all", "--x") is None
    assert parse_layers(" ALL ", "--x") is None
    assert parse_layers(None, "--x") is None
    assert parse_layers("2, 0,2", "--x") == [0, 2]
    assert parse_layers([3, 1], "--x") == [1, 3]
    for bad in ["a,b", "1;2", "", " , ", "-1", "0,-3", "1.5", "0,,1", "1,", 0, 1.0, {0: 1}]:
        with pytest.raises(ValueError) as e:  # an empty entry is refused, not skipped; one layer is '0' or [0]
            parse_layers(bad, "--my-layers-opt")
        assert "--my-layers-opt" in str(e.value), bad
    for bad in [None, 3, b"encoder-self"]:
        with pytest.raises(ValueError, match="--my-kinds-opt must be 'auto' or a comma-separated list"):
            parse_kinds(bad, "--my-kinds-opt")


def test_parse_layers_takes_integers_only():
    """``int()`` truncated 0.9 and 1.7 to layers 0 and 1, read True as layer 1 and the
    Arabic-Indic digit one as layer 1; each is refused, naming the option."""
    import numpy as np

    assert parse_layers([np.int64(2), 0], "--x") == [0, 2]  # any integer type with __index__
    for bad in [[0.9, 1.7], [True], [False, 1], ["1"], [1.0], "١", "٣,0", "１"]:
        with pytest.raises(ValueError, match="--my-layers-opt must be 'all' or a comma-separated list") as e:
            parse_layers(bad, "--my-layers-opt")
        assert repr(bad) in str(e.value)


def test_parse_kinds():
    assert parse_kinds("encoder-self, decoder-self,encoder-self", "--k") == ["encoder-self", "decoder-self"]
    assert parse_kinds(["encoder-decoder"], "--k") == ["encoder-decoder"]
    for bad in ["", " , ", "encoder", "encoder-self,cross"]:
        with pytest.raises(ValueError) as e:
            parse_kinds(bad, "--my-kinds-opt")
        assert "--my-kinds-opt" in str(e.value), bad


def test_a_pass_ends_even_on_error_and_the_one_outside_it_is_read_again():
    c = _controller(2)
    s0, s1 = c.sites
    with c.hooks({s1: "previous"}):
        with pytest.raises(RuntimeError):
            with c.hooks({s0: "a", s1: "b"}):
                assert (hook_in_progress(s0), hook_in_progress(s1)) == ("a", "b")
                raise RuntimeError("boom")
        assert (hook_in_progress(s0), hook_in_progress(s1)) == (None, "previous")
    assert (hook_in_progress(s0), hook_in_progress(s1)) == (None, None)


def test_ad_drop_layer_error_names_the_flag():
    with pytest.raises(ValueError) as e:
        ADDrop(ADDropConfig(layers="0,5"), _controller(2))
    assert "--ad-drop-layers" in str(e.value) and "0..1" in str(e.value)
    with pytest.raises(ValueError, match="decoder-self"):
        ADDrop(ADDropConfig(attention="decoder-self"), _controller(2))


def test_register_refuses_a_duplicate_and_selection_refuses_gaps():
    """A site registered twice is refused, and so is a selection over a kind whose layers leave a gap
    (layers 1 and 2, not 0..1), naming the registered layers and the indices accepted."""
    controller = RegularizationController()
    controller.register("encoder-self", 1)
    with pytest.raises(ValueError, match="encoder-self layer 1 is registered already"):
        controller.register("encoder-self", 1)
    controller.register("encoder-self", 2)
    with pytest.raises(
        ValueError, match=r"registered encoder-self attention at layers \[1, 2\], but layer indices must be 0\.\.1"
    ):
        controller.select(["encoder-self"], [1])
    with pytest.raises(ValueError, match="layer must be a 0-based integer index >= 0, got -1"):
        controller.register("decoder-self", -1)
    # any registration order is fine when the indices end up 0..n-1
    ordered = RegularizationController()
    for layer in (1, 0):
        ordered.register("decoder-self", layer)
    assert [s.layer for s in ordered.select(["decoder-self"], [1])] == [1]
