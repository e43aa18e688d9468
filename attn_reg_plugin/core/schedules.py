"""Old import path (until 0.2): scheduled dropout is in ``core.scheduled_dropout``, LayerDrop in ``core.layerdrop``."""
from .layerdrop import AttentionLayerDrop, AttentionLayerDropConfig  # noqa: F401
from .scheduled_dropout import (  # noqa: F401
    Schedule, ScheduledAttentionDropout, ScheduledDropoutConfig, parse_schedules, schedule_value,
)
