"""Silence the start-up warnings of fairseq 0.12 on today's hydra and torch that are known to be harmless.

Each filter names the message, the category and the module the warning is attributed to, so
anything else (the same text from other code, or another warning from these modules) still shows.
They are installed when the plugin's fairseq part is imported (``--user-dir``), which fairseq's
commands do before they compose their config, build the model or read data. What each one is:

- fairseq composes its config through hydra 1.0's API (``hydra.experimental``, ``strict=``,
  ``# @package _group_`` headers, schema matching by name); hydra 1.3 runs that API unchanged
  and warns on every command. fairseq 0.12 is not going to move to the new API, and the
  composed config is the same.
- fairseq's ``train_step`` opens ``torch.cuda.amp.autocast(enabled=...)`` on every update: a
  deprecated spelling of ``torch.amp.autocast("cuda", ...)``, same behaviour.
- fairseq's data loaders ask for ``pin_memory=True``; on a machine without an accelerator torch
  ignores it and says so.
- fairseq's own decoder self-attention passes a float future mask beside a bool padding mask to
  ``F.multi_head_attention_forward``, which converts one to the other's type and combines them
  correctly; torch warns that it will stop accepting the mixed types.
"""

import warnings

# (message regex, category, module regex); the modules are anchored, the messages match at their start.
KNOWN_HARMLESS = [
    (r"hydra\.experimental\.(initialize|compose)\(\) is no longer experimental", UserWarning, r"hydra\."),
    (r"\s*The version_base parameter is not specified", UserWarning, r"hydra\."),
    (r"In 'config': Usage of deprecated keyword in package header '# @package _group_'", UserWarning, r"hydra\."),
    (r"\s*The strict flag in the compose API is deprecated", UserWarning, r"hydra\."),
    # hydra warns about this one with a fixed stacklevel that points past fairseq's frames: Python
    # attributes it to "sys:1" in fairseq-train, to the console script (__main__) in fairseq-generate.
    (r"\s*'config' is validated against ConfigStore schema with the same name", UserWarning, r"(sys|__main__)\Z"),
    (r"`torch\.cuda\.amp\.autocast\(args\.\.\.\)` is deprecated", FutureWarning, r"fairseq\.tasks\.fairseq_task\Z"),
    (
        r"'pin_memory' argument is set as true but no accelerator is found",
        UserWarning,
        r"torch\.utils\.data\.dataloader\Z",
    ),
    (
        r"Support for mismatched key_padding_mask and attn_mask is deprecated",
        UserWarning,
        r"torch\.nn\.functional\Z",
    ),
]


def silence_known_harmless_warnings() -> None:
    for message, category, module in KNOWN_HARMLESS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)


silence_known_harmless_warnings()
