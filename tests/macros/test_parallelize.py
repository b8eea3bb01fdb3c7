"""``mg.parallelize(model, ...)``: the call-site macro (golden cases: tests/golden/parallelize_*)."""

from __future__ import annotations

import pytest

import macrogen as mg
from tests.helpers import expand, expansion_errors


def test_unexpanded_it_is_the_model_itself():
    model = object()
    assert mg.parallelize(model, tp=2, tp_plan="hf", dp="replicate") is model


def test_expands_to_a_generated_function_naming_each_step():
    code = expand(
        """
        import macrogen as mg

        model = mg.parallelize(build(), tp=2, tp_plan={"layers.*.q": "colwise", "layers.*.o": "rowwise"})
        """
    )
    assert "model = _parallelize_l4(build())" in code
    steps = (
        code.index("device_mesh(tp=2"),
        code.index("apply_tensor_parallel(model, mesh"),
        code.index("apply_data_parallel(model, mesh, 'replicate'"),
    )
    assert list(steps) == sorted(steps)  # mesh, then tensor parallel, then data parallel
    assert "'layers.*.q': 'colwise'," in code
    compile(code, "test.py", "exec")


def test_the_hf_plan_is_read_from_the_model_at_run_time():
    code = expand("import macrogen as mg\nm = mg.parallelize(m, tp=4, tp_plan='hf', dp='none')\n")
    assert "apply_tensor_parallel(model, mesh, hf_plan(model)" in code
    assert "apply_data_parallel" not in code


def test_degrees_may_be_defined_or_tunable():
    code = expand(
        """
        import macrogen as mg

        TP = mg.define(4)
        m = mg.parallelize(m, tp=TP, tp_plan="hf")
        n = mg.parallelize(n, tp=mg.tunable(2, choices=[1, 2]), tp_plan="hf")
        """
    )
    assert "device_mesh(tp=4," in code and "device_mesh(tp=2," in code


@pytest.mark.parametrize(
    "call, message",
    [
        ("mg.parallelize(m, tp=2)", "tp=2 needs a plan"),
        (
            "mg.parallelize(m, dp='fsdp', bucket_mb=4)",
            'bucket_mb applies with dp="replicate" or "zero1"',
        ),
        ("mg.parallelize(m, dp_replicate=2)", 'dp_replicate applies with dp="fsdp"'),
        ("mg.parallelize(m, dp='fsdp', shard_units=[])", "shard_units must be None or a list"),
        (
            "mg.parallelize(m, dp='fsdp', mixed_precision='fp8')",
            'mixed_precision must be None, "bf16"',
        ),
        ("mg.parallelize(m, dp='ddp')", 'dp must be "replicate", "zero1", "fsdp" or "none"'),
        ("mg.parallelize(m, tp=2, tp_plan={'a': 'rowise'})", "did you mean 'rowwise'?"),
        (
            "mg.parallelize(m, tp=2, tp_plan={'a': ('colwise', 0)})",
            "('colwise', n) takes an int n >= 1",
        ),
        ("mg.parallelize(m, tp=2, tp_plan={'a..b': 'colwise'})", "is not a dotted path"),
        ("mg.parallelize(m, tp=2, tp_plan='auto')", 'tp_plan must be "hf" or a non-empty dict'),
        ("mg.parallelize(m, tp=n, tp_plan='hf')", "'n' is not known at expansion time"),
        ("mg.parallelize(m, pp=2)", "pp=2 with schedule 1f1b needs at least as many micro-batches"),
        ("mg.parallelize(m, compress='int8')", 'compress must be None, "bf16" or "fp16"'),
        ("mg.parallelize(m, tp=mg.tunable(2, choices=[0, 2]), tp_plan='hf')", "a choice of 0"),
    ],
)
def test_bad_arguments_are_errors_at_the_argument(call, message):
    errors = expansion_errors(f"import macrogen as mg\nm = {call}\n")
    assert len(errors) == 1 and message in errors[0], errors


def test_fsdp_expands_to_fully_shard_with_the_settings():
    code = expand(
        "import macrogen as mg\nm = mg.parallelize(m, dp='fsdp', mixed_precision='bf16',"
        " shard_units=['layers.*'], dp_replicate=2)\n"
    )
    assert "apply_fully_sharded(model, mesh, FullyShardedConfig(" in code
    assert "mixed_precision='bf16'," in code and "shard_units=('layers.*',)," in code
    assert "dp_replicate=2," in code and "apply_data_parallel" not in code


def test_every_bad_plan_entry_in_one_error():
    (error,) = expansion_errors(
        "import macrogen as mg\nm = mg.parallelize(m, tp=2, tp_plan={'a': 'x', 'b': 'y', 'c': 'colwise'})\n"
    )
    assert "a: unknown style 'x'" in error and "b: unknown style 'y'" in error
