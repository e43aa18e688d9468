"""attn-reg-sharded-memory on a tiny BERT: it launches the ranks, and what sharding divides halves."""

import json

import pytest

from attn_reg_lab import sharded_memory


@pytest.mark.slow  # ~80 s of 2-rank runs; sharded training itself is tested in tests/test_fsdp.py
def test_model_state_per_rank_halves_on_two_ranks(tmp_path):
    out = tmp_path / "memory.json"
    argv = ["--hidden", "32", "--layers", "2", "--vocab", "2000", "--batch", "2", "--length", "8"]
    assert sharded_memory.main([*argv, "--methods", "plain,attendout", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "lock_sha256" in result["environment"]
    rows = {(r["method"], r["world"]): r for r in result["rows"]}
    assert set(rows) == {("plain", 1), ("plain", 2), ("attendout", 1), ("attendout", 2)}
    for method in ("plain", "attendout"):
        one, two = rows[(method, 1)]["model_state_mb"], rows[(method, 2)]["model_state_mb"]
        assert two == pytest.approx(one / 2, rel=0.05, abs=0.1)  # MB to one decimal; shards padded equal
        assert rows[(method, 1)]["step_peak_mb"] >= one
    # The Attacker and its optimizer are a second model state, sharded too.
    assert rows[("attendout", 1)]["model_state_mb"] == pytest.approx(2 * rows[("plain", 1)]["model_state_mb"], abs=0.15)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--methods", "plain,dropout"], "--methods: unknown 'dropout'"),
        (["--worlds", "0"], "--worlds: numbers of ranks"),
    ],
)
def test_bad_options_are_refused_before_any_rank_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        sharded_memory.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
