"""FSDP2 (``fully_shard``) on 2 CPU ranks over gloo: sharded training equals unsharded training.

tests/fsdp_rank.py (porting API) runs, on each rank, every scenario twice from the same seeds:
on an unsharded reference whose gradients are averaged over the ranks by hand (what DDP does),
and on the same model sharded with ``fully_shard``. Here the two must agree: the loss of every
update, AD-DROP's masks and counts, the full gathered gradients and the parameters after the
updates; for AttendOut, the Attacker's losses, the held-out duel, the survivor, the Generator
and both networks after the re-sync and one more update (so the optimizer state was copied too).
One launch runs every scenario (about 15 s), so all of it is in ``make test``.
"""

import sys

import pytest
import torch

from helpers import torchrun_ranks

FSDPModule = pytest.importorskip("torch.distributed.fsdp").FSDPModule

# One worker runs this module and each torchrun is made once a session: module-scoped and spread over
# the workers, each was made twice.
pytestmark = pytest.mark.xdist_group("fsdp")

WORLD = 2
SCENARIOS = [
    "ad-drop-ga",
    "ad-drop-aa",
    "ad-drop-rd",
    "ad-drop-iga",
    "scheduled-dropout",
    "layerdrop",
    "attendout",
    "ad-drop-bf16-parameters",
    "ad-drop-bf16-parameters-layers-only",
]


@pytest.fixture(scope="session")
def porting_runs(tmp_path_factory):
    return torchrun_ranks("fsdp_rank.py", tmp_path_factory.mktemp("fsdp"), *SCENARIOS)


def assert_same_tensors(reference, sharded, what, atol=1e-6):
    assert reference.keys() == sharded.keys(), what
    for name, ref in reference.items():
        got = sharded[name]
        assert (ref is None) == (got is None), f"{what} {name}: {ref is None=} but {got is None=}"
        if ref is not None:
            assert torch.allclose(ref, got, rtol=1e-5, atol=atol), (
                f"{what} {name}: max difference {(ref - got).abs().max().item():.3g}"
            )


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s != "attendout" and "bf16" not in s])
def test_fsdp2_training_equals_unsharded(porting_runs, scenario):
    for rank, results in enumerate(porting_runs):
        ref, fsdp = results[scenario]["reference"], results[scenario]["fsdp2"]
        assert len(ref["steps"]) == len(fsdp["steps"]) == 2
        for step, (r, f) in enumerate(zip(ref["steps"], fsdp["steps"])):
            where = f"{scenario} rank {rank} update {step + 1}"
            assert torch.allclose(r["loss"], f["loss"], rtol=1e-6, atol=1e-7), (where, r["loss"], f["loss"])
            if scenario.startswith("ad-drop"):
                assert r["droppable"] == f["droppable"] > 0 and r["dropped"] == f["dropped"] > 0, where
                assert len(r["masks"]) == len(f["masks"]) == 6, where  # one per attention site
                assert all(torch.equal(a, b) for a, b in zip(r["masks"], f["masks"])), f"{where}: masks differ"
            # Every parameter has a gradient in both (a frozen root after AA's no-grad pass had none).
            assert all(g is not None for g in f["grads"].values()), where
            assert_same_tensors(r["grads"], f["grads"], f"{where} gradient")
        assert_same_tensors(ref["params"], fsdp["params"], f"{scenario} rank {rank} parameters")
    # The ranks trained different halves of the batch yet hold the same (reduced) gradients.
    assert_same_tensors(porting_runs[0][scenario]["fsdp2"]["steps"][0]["grads"],
                        porting_runs[1][scenario]["fsdp2"]["steps"][0]["grads"], "rank 0 vs 1")  # fmt: skip
    assert (
        porting_runs[0][scenario]["fsdp2"]["steps"][0]["loss"] != porting_runs[1][scenario]["fsdp2"]["steps"][0]["loss"]
    )


def test_fsdp2_attendout_equals_unsharded(porting_runs):
    for rank, results in enumerate(porting_runs):
        ref, fsdp = results["attendout"]["reference"], results["attendout"]["fsdp2"]
        for r, f in zip(ref["steps"], fsdp["steps"]):
            assert torch.allclose(r["loss"], f["loss"], rtol=1e-6) and torch.allclose(
                r["attacker_loss"], f["attacker_loss"], rtol=1e-6
            )
            assert r["attacker_loss"] != r["loss"]  # the Attacker trained under the Generator's masks
        for name in ("defender", "attacker"):
            assert_same_tensors(ref["before_sync"][name], fsdp["before_sync"][name], f"rank {rank} {name} before")
            assert_same_tensors(ref["after"][name], fsdp["after"][name], f"rank {rank} {name} after the re-sync")
        assert (ref["keep_attacker"], ref["win_rate"]) == (fsdp["keep_attacker"], fsdp["win_rate"])
        assert ref["reward"] == pytest.approx(fsdp["reward"], abs=1e-6)
        assert_same_tensors(ref["generator"], fsdp["generator"], f"rank {rank} generator")
    # Before the re-sync the two networks differ; after it and one identical update they are equal.
    before = porting_runs[0]["attendout"]["fsdp2"]["before_sync"]
    assert any(not torch.equal(before["defender"][k], before["attacker"][k]) for k in before["defender"])
    after = porting_runs[0]["attendout"]["fsdp2"]["after"]
    assert_same_tensors(after["defender"], after["attacker"], "Defender vs Attacker after the re-sync")


@pytest.mark.parametrize("scenario", ["ad-drop-bf16-parameters", "ad-drop-bf16-parameters-layers-only"])
def test_fsdp2_mixed_precision_ad_drop_trains(porting_runs, scenario):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): attribution and masks in bf16; the
    frozen pass is the first forward, with the root sharded or only the layers."""
    for results in porting_runs:
        run = results[scenario]["fsdp2"]
        for step in run["steps"]:
            assert torch.isfinite(step["loss"]) and 0.05 < step["dropped"] / step["droppable"] < 0.3
            assert all(g.dtype == torch.float32 and torch.isfinite(g).all() for g in step["grads"].values())


def test_fsdp2_settings_that_are_refused(porting_runs):
    said = porting_runs[0]["refusals"]
    assert said["offload"].startswith("ADDrop does not support FSDP2 CPU offload (offload_policy=CPUOffloadPolicy")


def test_a_post_forward_reshard_to_a_smaller_mesh_is_refused(monkeypatch):
    """reshard_after_forward=<int> needs 4+ ranks; its trace in FSDP2's state is a post-forward mesh of its own."""
    from types import SimpleNamespace

    from attn_reg_plugin.core.training import sharding

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    model[0].__class__ = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})
    mesh, smaller = object(), object()
    groups = {"same": SimpleNamespace(offload_policy=None, mesh_info=mesh, post_forward_mesh_info=mesh),
              "none": SimpleNamespace(offload_policy=None, mesh_info=mesh, post_forward_mesh_info=None),
              "int": SimpleNamespace(offload_policy=None, mesh_info=mesh, post_forward_mesh_info=smaller)}  # fmt: skip
    for name in ("same", "none"):
        monkeypatch.setattr(sharding, "_param_groups", lambda module, g=groups[name]: [g])
        sharding.check_supported_sharding(model, "ADDrop")
    monkeypatch.setattr(sharding, "_param_groups", lambda module: [groups["int"]])
    with pytest.raises(NotImplementedError, match=r"ADDrop does not support FSDP2 reshard_after_forward=<int>"):
        sharding.check_supported_sharding(model, "ADDrop")


def test_a_sharded_defender_cannot_be_copied_into_an_attacker():
    from attn_reg_plugin.core.regularizers.attendout import build_attacker
    from attn_reg_plugin.core.training.sharding import is_fully_sharded

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    # What fully_shard does to a module's class, without a process group.
    model[0].__class__ = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})
    assert is_fully_sharded(model) and not is_fully_sharded(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already sharded with FSDP2.*Build the Attacker from the unsharded model"):
        build_attacker(model, lambda m, c: None)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


# *-llama: a causal LM sharded by accelerate's own fsdp2_prepare_model (the Trainer's FSDP2 path): the
# embedding a unit of its own, the final norm and head (tied or not) one unit, a root without parameters.
HF_SCENARIOS = [
    "ad-drop",
    "ad-drop-checkpointing",
    "ad-drop-reentrant",
    "scheduled-dropout",
    "attendout",
    "attendout-checkpointing",
    "ad-drop-llama",
    "attendout-llama",
    "attendout-llama-tied",
]
ATTENDOUT_HF = [s for s in HF_SCENARIOS if s.startswith("attendout")]


@pytest.fixture(scope="session")
def hf_runs(tmp_path_factory):
    pytest.importorskip("transformers")
    return torchrun_ranks("fsdp_hf_rank.py", tmp_path_factory.mktemp("fsdp-hf"), *HF_SCENARIOS)


@pytest.mark.parametrize("scenario", HF_SCENARIOS)
def test_fsdp2_hf_trainer_steps_equal_unsharded(hf_runs, scenario):
    """The trainers' own training_step and callbacks on a fully_shard-ed BERT (3 updates)."""
    for rank, results in enumerate(hf_runs):
        ref, fsdp = results[scenario]["reference"], results[scenario]["fsdp2"]
        for step, (r, f) in enumerate(zip(ref["steps"], fsdp["steps"])):
            where = f"{scenario} rank {rank} update {step + 1}"
            assert torch.allclose(r["loss"], f["loss"], rtol=1e-6, atol=1e-7), (where, r["loss"], f["loss"])
            assert all(g is not None for g in f["grads"].values()), where
            assert_same_tensors(r["grads"], f["grads"], f"{where} gradient")
        assert ref["counts"] == fsdp["counts"]  # the logged counts, summed over the ranks
        if not scenario.startswith("attendout"):
            assert fsdp["counts"][0] > 0  # something was dropped
        assert_same_tensors(ref["params"], fsdp["params"], f"{scenario} rank {rank} parameters")


@pytest.mark.parametrize("scenario", ATTENDOUT_HF)
def test_fsdp2_hf_attendout_attacker_and_its_saved_state(hf_runs, scenario):
    """The Attacker is built sharded like the Defender, trains like the unsharded one, and its
    attendout.pt (gathered, keyed by name) loads back into a fresh sharded Attacker and optimizer."""
    for rank, results in enumerate(hf_runs):
        ref, fsdp = results[scenario]["reference"], results[scenario]["fsdp2"]
        # A is sharded in the same units as D (accelerate's grouped head unit included).
        assert fsdp["attacker_fsdp_units"] == fsdp["defender_fsdp_units"] and fsdp["defender_fsdp_units"]
        # The Trainer turned checkpointing on for D after the trainer was built; A has it too.
        assert ref["attacker_checkpointed"] == fsdp["attacker_checkpointed"]
        assert bool(fsdp["attacker_checkpointed"]) == scenario.endswith("checkpointing")
        assert ref["dropout_steps"] == fsdp["dropout_steps"] == 1
        assert_same_tensors(ref["attacker"], fsdp["attacker"], f"rank {rank} Attacker")
        assert fsdp["saved_optimizer_keys"] == ["attacker_optimizer_by_name"]
        assert ref["saved_optimizer_keys"] == ["attacker_optimizer"]
        for run in (ref, fsdp):
            assert_same_tensors(run["attacker"], run["loaded_attacker"], f"rank {rank} loaded Attacker", atol=0)
            assert run["momentum"] and run["momentum"].keys() == run["loaded_momentum"].keys()
            assert_same_tensors(run["momentum"], run["loaded_momentum"], f"rank {rank} loaded momentum", atol=0)
        assert_same_tensors(ref["momentum"], fsdp["momentum"], f"rank {rank} Attacker momentum")


def test_attendout_trainer_refuses_a_model_sharded_before_it(hf_runs):
    message = hf_runs[0]["refusals"]["AttendOutTrainer"]
    assert message is not None and message.startswith("AttendOutTrainer needs the unsharded model")
    assert "fsdp_config={'version': 2}" in message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (make gpu-check on a GPU machine)")
@pytest.mark.parametrize("kind", ["ad-drop", "scheduled-dropout", "attendout"])
def test_hf_trainer_runs_fsdp2_end_to_end(tmp_path, kind):
    """The Trainer's own FSDP2 path (accelerate shards the model), one rank per GPU, with activation
    checkpointing, a checkpoint per epoch and (AttendOut) a resume from the last one."""
    result = torchrun_ranks("fsdp_trainer_rank.py", tmp_path, kind, world=min(torch.cuda.device_count(), 2))[0]
    assert result["sharded"]
    logs = [h for h in result["log_history"] if "loss" in h]
    assert logs and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    if kind == "ad-drop":
        assert all(0.05 < h["ad_drop_rate"] < 0.3 for h in logs)
        print("FSDP2 AD-DROP rates:", [h["ad_drop_rate"] for h in logs])
    if kind == "attendout":
        assert result["attacker_sharded"] and result["game"] >= 2
        assert result["resumed_game"] > result["game"]


def test_ad_drop_refuses_an_fsdp1_model_on_its_first_step():
    """The core API has no construction-time model: ADDrop checks the model of its first masked step."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from attn_reg_plugin.core import ADDrop, ADDropConfig
    from helpers import controller_with_sites

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    # What FSDP1's wrapper is to isinstance, without a process group.
    model[0].__class__ = type("FSDP1Linear", (FullyShardedDataParallel, torch.nn.Linear), {})
    ad_drop = ADDrop(ADDropConfig(attention="encoder-self"), controller_with_sites({"encoder-self": 1}))
    with pytest.raises(NotImplementedError, match=r"^ADDrop does not support FSDP1"):
        with ad_drop.masked(lambda: None, None, frozen=model):
            pass
