"""ad_drop_epoch takes 1-based integer epochs (paper Alg. 1: plain on odd epochs). A 0-based
``for epoch in range(n)`` loop would silently swap cross-tuning's phases, so an epoch < 1, a
non-integer and a bool are refused, with a message that says epochs are 1-based."""

import numpy as np
import pytest

from attn_reg_plugin.core import ad_drop_epoch
from attn_reg_plugin.core.regularizers.ad_drop_config import first_ad_drop_epoch

pytestmark = pytest.mark.host_only  # no device branch: the portable run skips it

ONE_BASED = r"epoch must be a 1-based integer >= 1 \(the first epoch is 1\), got "


@pytest.mark.parametrize("schedule", ["cross-tuning", "always"])
@pytest.mark.parametrize("epoch", [0, -1, -2, 1.0, 2.5, float("nan"), True, False, "2", None])
def test_an_epoch_that_is_not_a_1_based_integer_is_refused(schedule, epoch):
    with pytest.raises(ValueError, match=ONE_BASED + "(0|-1|-2|1.0|2.5|nan|True|False|'2'|None)$"):
        ad_drop_epoch(schedule, epoch)


def test_epoch_0_is_refused_not_taken_as_an_ad_drop_epoch():
    with pytest.raises(ValueError, match=ONE_BASED + "0$"):
        ad_drop_epoch("cross-tuning", 0)  # was True: a 0-based loop ran AD-DROP on its first epoch


def test_1_based_integer_epochs_alternate_plain_first():
    assert [ad_drop_epoch("cross-tuning", e) for e in range(1, 7)] == [False, True, False, True, False, True]
    assert all(ad_drop_epoch("always", e) for e in range(1, 7))
    assert ad_drop_epoch("cross-tuning", np.int64(2)) is True  # an integer of another kind is an integer
    assert first_ad_drop_epoch("cross-tuning", 2) == 2 and first_ad_drop_epoch("always", 1) == 1


def test_a_bad_schedule_is_still_named():
    with pytest.raises(ValueError, match="schedule must be one of cross-tuning, always, got 'never'"):
        ad_drop_epoch("never", 2)
