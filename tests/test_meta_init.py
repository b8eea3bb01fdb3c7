"""``init=`` of ``mg.parallelize`` without ranks: its checks, its expansion, the serial program's
values (the unexpanded marker), ``mg.load`` of a plain torch model, and the device chosen."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import macrogen as mg
from macrogen.expand import ExpansionError
from macrogen.runtime import groups, materialize
from tests.helpers import expand


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3, bias=False)
        self.register_buffer("scale", torch.arange(3.0), persistent=False)

    def reset_parameters(self):  # the buffer a meta build leaves without values
        self.scale.copy_(torch.arange(3.0))


def _meta() -> Net:
    with torch.device("meta"):
        return Net()


def test_a_meta_model_without_init_is_an_error_naming_the_fix():
    with pytest.raises(ValueError, match=r"meta device \(fc.weight, ...\): pass init=mg.load"):
        materialize.check_init(_meta(), None, where="train.py:3")


def test_init_model_on_a_model_with_values_is_an_error():
    with pytest.raises(ValueError, match='init="model" initializes a model built on the meta'):
        materialize.check_init(Net(), "model", where="train.py:3")


def test_init_of_another_kind_and_a_folder_without_a_checkpoint_are_errors(tmp_path):
    with pytest.raises(ValueError, match=r"init='zeros': expected mg.load\(path\) or \"model\""):
        materialize.check_init(_meta(), "zeros", where="train.py:3")
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        materialize.check_init(_meta(), mg.load(tmp_path), where="train.py:3")


def test_unexpanded_init_model_equals_the_model_built_with_values():
    """Each module's reset_parameters() in construction order: the serial build's draws."""
    torch.manual_seed(3)
    built = Net()
    torch.manual_seed(3)
    meta = mg.parallelize(_meta(), init="model")
    for (name, want), got in zip(built.state_dict().items(), meta.state_dict().values()):
        assert torch.equal(got, want), name
    assert torch.equal(meta.scale, torch.arange(3.0))


def test_mg_load_of_a_dcp_folder_and_over_a_model_with_values(tmp_path):
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(4)
    saved = Net()
    dcp.save(saved.state_dict(), checkpoint_id=str(tmp_path))
    loaded = mg.parallelize(_meta(), init=mg.load(tmp_path))
    over = mg.parallelize(Net(), init=mg.load(tmp_path))  # a model with values: read over them
    for model in (loaded, over):
        for name, want in saved.state_dict().items():
            assert torch.equal(model.state_dict()[name], want), name


def test_the_device_is_the_ranks_own(monkeypatch):
    """to_empty goes to groups.placement()'s device (cuda:LOCAL_RANK under NCCL)."""
    seen = []
    real = nn.Module.to_empty

    def to_empty(self, *, device, recurse=True):
        seen.append(torch.device(device))
        return real(self, device="cpu", recurse=recurse)

    placement = groups.choose_placement(
        cuda_available=True, device_count=2, local_rank=1, local_world_size=2, requested=None
    )
    monkeypatch.setattr(groups, "placement", lambda: placement)
    monkeypatch.setattr(nn.Module, "to_empty", to_empty)
    mg.parallelize(_meta(), init="model")
    assert seen == [torch.device("cuda:1")]


def test_init_is_kept_in_the_call_and_materializes_after_fsdp():
    code = expand(
        """
        import macrogen as mg
        model = mg.parallelize(model, dp="fsdp", init=mg.load("ckpt"))
        """
    )
    assert 'model = _parallelize_l3(model, init=mg.load("ckpt"))' in code
    assert code.index("apply_fully_sharded(model") < code.index("apply_init(model, init")
    assert code.index("check_init(model, init") < code.index("parallelize_once(model")


def test_init_before_data_parallel_when_it_is_replicated():
    code = expand(
        """
        import macrogen as mg
        model = mg.parallelize(model, init="model")
        """
    )
    assert code.index("apply_init(model, init") < code.index("apply_data_parallel(model")


def test_init_with_a_pipeline_materializes_after_the_cut():
    """Each stage allocates its own parts only: the cut first (on the meta model), then init."""
    for dp in ("none", "fsdp"):
        code = expand(
            f"""
            import macrogen as mg
            model = mg.parallelize(model, pp=2, microbatches=2, dp="{dp}", init="model")
            """
        )
        assert code.index("apply_pipeline(model") < code.index("apply_init(model, init"), dp


@pytest.mark.parametrize(
    "given", ['tp_plan={"wte": "server"}, servers=1, dp="none"', "verify=True"]
)
def test_init_with_servers_or_verify_is_refused_at_its_argument(given):
    name = "servers" if "servers" in given else "verify"
    with pytest.raises(ExpansionError, match=f"not yet with {name}="):
        expand(
            f"""
            import macrogen as mg
            model = mg.parallelize(model, {given}, init="model")
            """
        )


def test_a_meta_model_is_checked_before_the_cut_on_fake_tensors():
    """A meta Llama's stages run on shapes (no values); a mixture's routing reads values."""
    pytest.importorskip("transformers")
    from macrogen.runtime.pipeline_transformers import transformers_cut
    from tests import meta_models

    cut = transformers_cut(meta_models.meta_model("llama"), 2, where="train.py:3")
    assert cut.describe().startswith("stage 0: model.embed_tokens, model.layers.0 | stage 1")
    with pytest.raises(ValueError, match=r"meta device, and its forward can't run on shapes alo"):
        transformers_cut(meta_models.meta_model("qwen2_moe"), 2, where="train.py:3")
