"""The kernel's A/B timing (attn_reg_lab.edit_call_timing) runs every case and refuses a bad count."""

import pytest

from attn_reg_lab import edit_call_timing


def test_every_case_is_timed_once_warm(capsys, monkeypatch):
    small = {"ga-dropout": (2, 2, 6, 4, 0.1, "ga"), "coins": (2, 2, 6, 4, 0.0, "coins")}
    monkeypatch.setattr(edit_call_timing, "CASES", small)  # the real shapes take seconds each
    rows = edit_call_timing.main(["--reps", "1"])
    assert list(rows) == list(small)
    assert all(ms > 0 for ms in rows.values())
    assert capsys.readouterr().out.strip().startswith("{")


def test_a_count_below_one_is_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        edit_call_timing.main(["--reps", "0"])
    assert "--reps must be at least 1, got 0" in capsys.readouterr().err
