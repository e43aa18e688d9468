"""The few-shot runner's methods are the plugin's (:mod:`attn_reg_plugin.hf.methods`, the trainers
attn-reg-cls-compare builds): plain, AD-DROP, AttendOut and the papers' baselines (R-Drop, HiddenCut,
DropHead, DropKey, AD-DROP + R-Drop), each with its options and their defaults for classifiers."""

from attn_reg_plugin.hf.methods import METHODS, Method, add_method_options

__all__ = ["METHODS", "Method", "add_method_options"]
