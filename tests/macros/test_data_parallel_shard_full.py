"""``@mg.data_parallel(shard="full")`` (FSDP for a class of the user's own) and FSDP with
``mg.shard_optimizer``: what they expand to and the errors they report at expansion.

Golden cases: tests/golden/data_parallel_shard_full*; the distributed parity runs in
tests/test_fsdp_rest_dist.py.
"""

from __future__ import annotations

import pytest

from tests.helpers import expand, expansion_errors

NET = """\
import torch
import torch.nn as nn
import macrogen as mg

@mg.data_parallel({args})
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
"""


def test_shard_full_expands_to_parallelizes_fsdp_apply():
    code = expand(NET.format(args='shard="full", mixed_precision="bf16", shard_units=["fc"]'))
    # the class's decorator applies FSDP2 as mg.parallelize's dp="fsdp" does (class_macros)
    assert "from macrogen.runtime import FullyShardedConfig" in code
    assert "fully_sharded=FullyShardedConfig(" in code
    assert "GradientSync" not in code and "def _apply" not in code
    assert "mixed_precision='bf16'," in code and "shard_units=('fc',)," in code
    compile(code, "test.py", "exec")


def test_without_shard_it_is_replicated_as_before():
    code = expand(NET.format(args=""))
    assert "GradientSync" in code and "apply_fully_sharded" not in code


@pytest.mark.parametrize(
    "args, message",
    [
        (
            'shard="zero3"',
            "test.py:5:25: error: shard must be None or \"full\" (FSDP), not 'zero3'",
        ),
        ("shard=True", 'test.py:5:25: error: shard must be None or "full" (FSDP), not True'),
        (
            'shard=mg.tunable(None, choices=[None, "half"])',
            "test.py:5:25: error: shard must be None or \"full\" (FSDP), not a choice of 'half'",
        ),
        (
            'shard="full", compress="bf16"',
            "test.py:5:42: error: compress applies with replicated parameters (no shard=), and"
            " shard is 'full'",
        ),
        (
            "reshard_after_forward=False",
            'test.py:5:41: error: reshard_after_forward applies with shard="full" (FSDP), and'
            " shard is None",
        ),
        (
            'shard="full", mixed_precision="fp8"',
            'test.py:5:49: error: mixed_precision must be None, "bf16" or "fp16", not \'fp8\'',
        ),
        (
            'shard="full", dp_replicate=0',
            "test.py:5:46: error: dp_replicate must be an int >= 1, not 0",
        ),
    ],
)
def test_bad_arguments_are_errors_at_their_position(args, message):
    errors = expansion_errors(NET.format(args=args))
    assert len(errors) == 1 and errors[0].startswith(message), errors


SHARDED_OPTIMIZER = "mg.shard_optimizer(torch.optim.AdamW(model.parameters()))"


@pytest.mark.parametrize(
    "source, at",
    [
        (  # the optimizer after the model, as programs are written
            f'model = mg.parallelize(build(), dp="fsdp")\nopt = {SHARDED_OPTIMIZER}\n',
            'test.py:3:36: error: dp="fsdp" (FSDP) already shards the optimizer state with the'
            " parameters: mg.shard_optimizer at test.py:4 is redundant",
        ),
        (  # a function that builds the optimizer, defined before the model
            f"def make(model):\n    return {SHARDED_OPTIMIZER}\n"
            'model = mg.parallelize(build(), dp=mg.tunable("replicate", choices=["replicate", "fsdp"]))\n',
            'test.py:5:36: error: dp="fsdp" (FSDP) already shards the optimizer state with the'
            " parameters: mg.shard_optimizer at test.py:4 is redundant",
        ),
        (
            '@mg.data_parallel(shard="full")\nclass Net(nn.Module):\n    pass\n'
            f"opt = {SHARDED_OPTIMIZER}\n",
            'test.py:3:25: error: shard="full" (FSDP) already shards the optimizer state with the'
            " parameters: mg.shard_optimizer at test.py:6 is redundant",
        ),
    ],
)
def test_fsdp_with_shard_optimizer_is_an_error_at_the_fsdp_argument(source, at):
    errors = expansion_errors("import torch\nimport macrogen as mg\n" + source)
    assert len(errors) == 1 and errors[0].startswith(at), errors


def test_a_file_with_a_replicated_model_too_may_shard_its_optimizer():
    """A benchmark beside FSDP: mg.shard_optimizer may be for the replicated model."""
    code = expand(
        "import torch\nimport torch.nn as nn\nimport macrogen as mg\n"
        "@mg.data_parallel()\nclass Net(nn.Module):\n    pass\n"
        f"def zero(model):\n    return {SHARDED_OPTIMIZER}\n"
        'def fsdp(model):\n    return mg.parallelize(model, dp="fsdp")\n'
    )
    assert "shard_optimizer(" in code and "apply_fully_sharded" in code


def test_zero1_and_replicate_go_with_shard_optimizer():
    for dp in ("zero1", "replicate"):
        code = expand(
            f'import torch\nimport macrogen as mg\nmodel = mg.parallelize(m, dp="{dp}")\n'
            f"opt = {SHARDED_OPTIMIZER}\n"
        )
        assert "shard_optimizer(" in code
