"""@data_parallel: what it expands to, the errors it reports, and the runtime pieces it uses.

Distributed parity lives in ``tests/test_data_parallel_dist.py``; here everything
runs in this process (world size 1 without torchrun).
"""

import pytest
import torch
import torch.nn as nn

from macrogen.runtime.agreement import fingerprint, first_difference
from macrogen.runtime.buckets import plan_buckets
from macrogen.runtime.data_parallel import DataParallelConfig, GradientSync, gradient_sync
from macrogen.runtime.mesh import SERIAL
from tests.helpers import expand, expansion_errors, load_module

NET = """\
import torch.nn as nn
import macrogen as mg

@mg.data_parallel({args})
class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return self.fc(x).square().mean()
"""


def test_the_class_keeps_its_body_its_name_and_identity(tmp_path):
    """``Net`` is the user's class itself (its __init__, forward, parameter names; no
    subclass) with a gradient sync built from the written arguments. What the expansion writes, byte for byte, is
    the goldens' (tests/golden/data_parallel_*)."""
    serial_ns: dict = {}
    exec(compile(NET.format(args=""), "serial.py", "exec"), serial_ns)
    code = expand(NET.format(args="compress='bf16', accumulate=2"))
    expanded = load_module(code, "dp_subclass", tmp_path)
    assert "@mg.data_parallel" not in code and "# macrogen: data_parallel at test.py:4" in code
    torch.manual_seed(0)
    net = expanded.Net(8)
    torch.manual_seed(0)
    reference = serial_ns["Net"](8)
    assert type(net) is expanded.Net and expanded.Net.__mro__[1] is nn.Module  # no subclass
    assert list(net.state_dict()) == list(reference.state_dict()) == ["fc.weight", "fc.bias"]
    x = torch.randn(4, 8)
    assert torch.equal(net(x), reference(x))  # the user's forward, unchanged
    sync = gradient_sync(net)
    assert sync.module is net and sync.where == "test.py:4"
    assert sync.config == DataParallelConfig(compress="bf16", accumulate=2)
    net(x)  # the first forward plans the buckets
    net.to(torch.float64)  # _apply: planned again at the next forward
    assert not sync.started


def test_bare_decorator_takes_the_defaults_and_names_stay_hygienic():
    code = expand(NET.replace("({args})", "").replace("self.fc", "self.data_parallel_class"))
    assert "@_mg_data_parallel_class(" in code
    assert "class Net(nn.Module):" in code
    assert "bucket_mb=25," in code and "compress=None," in code


def test_tunable_arguments_take_the_tuned_value():
    code = expand(
        NET.format(args="bucket_mb=mg.tunable(25, choices=[4, 25])"),
        tuning={"Net.bucket_mb": 4},
    )
    assert "bucket_mb=4," in code
    assert "# tunable Net.bucket_mb = 4 (tuned; choices [4, 25])" in code


@pytest.mark.parametrize(
    "args, message",
    [
        ("bucket_mb=0", "test.py:4:29: error: bucket_mb must be a positive number of MiB, not 0"),
        (
            "bucket_mb='25'",
            "test.py:4:29: error: bucket_mb must be a positive number of MiB, not '25'",
        ),
        (
            "first_bucket_mb=-1",
            "test.py:4:35: error: first_bucket_mb must be a positive number of MiB, not -1",
        ),
        (
            "compress='int8'",
            'test.py:4:28: error: compress must be None, "bf16" or "fp16", not \'int8\'',
        ),
        (
            "accumulate=0",
            "test.py:4:30: error: accumulate must be a whole number of backward passes >= 1, not 0",
        ),
        (
            "accumulate=2.0",
            "test.py:4:30: error: accumulate must be a whole number of backward passes >= 1, not 2.0",
        ),
        (
            "broadcast_buffers=1",
            "test.py:4:37: error: broadcast_buffers must be True or False, not 1",
        ),
        (
            "compress=mg.tunable(None, choices=[None, 'int4'])",
            'test.py:4:28: error: compress must be None, "bf16" or "fp16", not a choice of \'int4\'',
        ),
        (
            "sync_every=0",
            "test.py:4:30: error: sync_every must be a whole number of optimizer steps >= 1, not 0",
        ),
        (
            "sync_warmup=-1",
            "test.py:4:31: error: sync_warmup must be a whole number of optimizer steps >= 0, not -1",
        ),
        ("25", "test.py:4:19: error: this macro takes keyword arguments only"),
        ("bucket=25", "test.py:4:26: error: unknown argument 'bucket'; did you mean 'bucket_mb'?"),
    ],
)
def test_bad_arguments_are_errors_at_their_position(args, message):
    errors = expansion_errors(NET.format(args=args))
    assert len(errors) == 1 and errors[0].startswith(message), errors


def test_unsupported_uses_say_what_is_supported():
    on_function = "import macrogen as mg\n@mg.data_parallel()\ndef f():\n    pass\n"
    assert expansion_errors(on_function) == [
        "test.py:2:2: error: data_parallel() decorates a class: @data_parallel(bucket_mb=25,"
        " first_bucket_mb=1, compress=None, accumulate=1, broadcast_buffers=True, sync_every=1,"
        " sync_warmup=0, outer=None, overlap=False, delay=1) decorates an nn.Module class"
    ]
    no_base = "import macrogen as mg\n@mg.data_parallel()\nclass Net:\n    pass\n"
    assert expansion_errors(no_base) == [
        "test.py:3:7: error: data_parallel() decorates an nn.Module subclass; Net has no base class"
    ]
    named_super = NET.format(args="").replace("super().__init__()", "super(Net, self).__init__()")
    assert "super(Net, self).__init__()" in expand(named_super)  # the class keeps its name


@pytest.mark.slow
def test_without_torchrun_it_is_the_serial_model(tmp_path):
    """World size 1: no hooks, no buffers; training is bit for bit the serial program's."""
    serial_ns: dict = {}
    exec(compile(NET.format(args="accumulate=2"), "serial.py", "exec"), serial_ns)
    expanded = load_module(expand(NET.format(args="accumulate=2")), "dp_world1", tmp_path)
    results = []
    for cls in (serial_ns["Net"], expanded.Net):
        torch.manual_seed(0)
        model = cls(8)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        x = torch.randn(4, 8)
        for _ in range(3):
            opt.zero_grad()
            model(x).backward()
            opt.step()
        results.append(model.state_dict())
    assert list(results[0]) == list(results[1]) == ["fc.weight", "fc.bias"]
    for key in results[0]:
        assert torch.equal(results[0][key], results[1][key])
    sync = gradient_sync(model)
    assert sync.world_size == 1 and not sync.buckets
    model.to(torch.float64)  # _apply: the buckets are planned again at the next forward
    assert not sync.started


def test_gradient_sync_needs_a_module():
    with pytest.raises(TypeError, match="needs an nn.Module subclass"):
        GradientSync(object(), DataParallelConfig(), where="x.py:1", mesh=SERIAL)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="is not a @data_parallel model"):
        gradient_sync(nn.Linear(2, 2))


def _params(*sizes, dtype=torch.float32):
    return [torch.zeros(n, dtype=dtype) for n in sizes]


def test_buckets_take_parameters_in_reverse_order_with_a_smaller_first_bucket():
    params = _params(100, 100, 100, 100, 100, 100)  # 400 bytes each
    plan = plan_buckets(params, bucket_bytes=1000, first_bucket_bytes=400)
    assert [b.indices for b in plan] == [(5,), (4, 3, 2), (1, 0)]
    assert [b.offsets for b in plan] == [(0,), (0, 100, 200), (0, 100)]
    assert [b.numel for b in plan] == [100, 300, 200]


def test_buckets_hold_one_dtype_and_a_large_parameter_alone():
    params = [*_params(10), *_params(10, dtype=torch.float16), *_params(1000), *_params(10)]
    plan = plan_buckets(params, bucket_bytes=100, first_bucket_bytes=100)
    assert [(b.indices, b.dtype) for b in plan] == [
        ((3, 2), torch.float32),  # 40 + 4000 bytes: closes past the cap
        ((1,), torch.float16),  # still open at the end: closed in order of opening
        ((0,), torch.float32),
    ]


def test_fingerprints_name_the_first_differing_parameter():
    a = fingerprint(["w", "b"], [(2, 3), (3,)], ["float32"] * 2, [0, 0], "bucket_mb=25")
    b = fingerprint(["w", "b"], [(2, 4), (3,)], ["float32"] * 2, [0, 0], "bucket_mb=25")
    assert first_difference(a, a) is None
    assert first_difference(a, b) == (
        "parameter 0",
        "'w' float32 (2, 3) in bucket 0",
        "'w' float32 (2, 4) in bucket 0",
    )
    extra = fingerprint(
        ["w", "b", "c"], [(2, 3), (3,), (1,)], ["float32"] * 3, [0, 0, 1], "bucket_mb=25"
    )
    assert first_difference(a, extra) == ("parameter 2", "absent", "'c' float32 (1,) in bucket 1")
    other = fingerprint(["w", "b"], [(2, 3), (3,)], ["float32"] * 2, [0, 0], "bucket_mb=4")
    assert first_difference(a, other) == (
        "the data_parallel setting",
        "bucket_mb=25",
        "bucket_mb=4",
    )


def test_nested_data_parallel_models_are_refused():
    inner = nn.Linear(2, 2)
    inner.sync = GradientSync(inner, DataParallelConfig(), where="x.py:1", mesh=SERIAL)
    outer = nn.Sequential(inner)
    with pytest.raises(TypeError, match="its submodule '0' is @data_parallel too"):
        GradientSync(outer, DataParallelConfig(), where="x.py:2", mesh=SERIAL)
