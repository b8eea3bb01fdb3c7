"""@tensor_parallel(plan=...) -> the user's class, unrenamed, with its plan recorded on it."""

import textwrap

import pytest
import torch

from tests.helpers import assert_expands, expand, expansion_errors, load_module

MLP = """\
import torch.nn as nn
import macrogen as mg


@mg.tensor_parallel(plan={PLAN}{EXTRA})
class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.n_head = 4
        self.ratio = 0.5
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.wte = nn.Embedding(10, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, x):
        return self.proj(self.fc(x))
"""


def mlp(plan: str, extra: str = "") -> str:
    return MLP.replace("{PLAN}", plan).replace("{EXTRA}", extra)


def test_class_keeps_its_name_and_carries_its_plan_as_data():
    assert_expands(
        """\
        import torch.nn as nn
        import macrogen as mg


        @mg.tensor_parallel(plan={"fc": "colwise", "proj": "rowwise"}, size=2)
        class MLP(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.fc = nn.Linear(d, 4 * d)
                self.proj = nn.Linear(4 * d, d)
        """,
        """\
        import torch.nn as nn
        import macrogen as mg

        # ---- macrogen: generated from test.py; edit the source, not this block ----
        from macrogen.runtime import tensor_parallel_class


        # macrogen: tensor_parallel at test.py:5
        # the plan, as data on the class: this rank's shards are cut once the outermost decorated model is built
        @tensor_parallel_class('MLP', 2, {
            'fc': 'colwise',  # output features split; its output is sharded on the last dim
            'proj': 'rowwise',  # input features split; partial outputs all-reduced, bias added once
        })
        class MLP(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.fc = nn.Linear(d, 4 * d)
                self.proj = nn.Linear(4 * d, d)
        """,
    )


def test_every_style_renders_one_line_and_divide_names_the_attribute():
    code = expand(
        mlp(
            '{"fc": "colwise", "proj": "rowwise", "wte": "vocab", "n_head": "divide", "ln": "replicate"}'
        )
    )
    assert "'fc': 'colwise',  # output features split" in code
    assert "'proj': 'rowwise',  # input features split" in code
    assert "'wte': 'vocab',  # vocabulary split" in code
    assert "'n_head': 'divide',  # divided by the tensor-parallel size" in code
    assert "'ln': 'replicate',  # replicated (every rank holds all of it)" in code
    assert "@tensor_parallel_class('MLP', None, {" in code  # size from the launch


def test_packed_colwise_passes_its_block_count():
    code = expand(mlp('{"fc": ("colwise", 4), "proj": "rowwise"}'))
    assert "'fc': ('colwise', 4),  # output features split in each of 4 packed blocks" in code


def test_size_may_be_tunable_and_the_tuning_database_picks_it():
    source = mlp('{"fc": "colwise"}', ", size=mg.tunable(2, choices=[1, 2, 4])")
    assert "@tensor_parallel_class('MLP', 2, {" in expand(source)
    assert "@tensor_parallel_class('MLP', 4, {" in expand(source, tuning={"MLP.size": 4})


def test_dotted_paths_into_a_submodule_of_this_file():
    code = expand(
        """\
        import torch.nn as nn
        import macrogen as mg

        class Inner(nn.Module):
            def __init__(self):
                super().__init__()
                self.up = nn.Linear(4, 8)

        @mg.tensor_parallel(plan={"inner.up": "colwise"})
        class Outer(nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = Inner()
        """
    )
    assert "'inner.up': 'colwise'," in code


def test_generated_names_are_hygienic():
    code = expand(
        """\
        import torch.nn as nn
        import macrogen as mg

        tensor_parallel_class = None

        @mg.tensor_parallel(plan={"fc": "colwise"})
        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 8)
        """
    )
    assert "@_mg_tensor_parallel_class('MLP', None, {" in code
    assert "class MLP(nn.Module):" in code
    assert "'fc': 'colwise'," in code  # the plan in the engine's style names: data


def test_serial_run_of_the_expanded_class_is_the_serial_module(tmp_path):
    """Without torchrun the expanded module is world size 1: same parameters, same output."""
    source = textwrap.dedent(mlp('{"fc": "colwise", "proj": "rowwise", "n_head": "divide"}'))
    serial = load_module(source, "tp_unit_serial", tmp_path)
    parallel = load_module(expand(source), "tp_unit_parallel", tmp_path)
    torch.manual_seed(0)
    a = serial.MLP(8)
    torch.manual_seed(0)
    b = parallel.MLP(8)
    x = torch.randn(3, 8)
    torch.testing.assert_close(b(x), a(x))
    assert type(b) is parallel.MLP and type(b).__name__ == "MLP" and b.n_head == 4
    assert list(b.full_state_dict()) == list(a.state_dict())


@pytest.mark.parametrize(
    "plan, extra, message",
    [
        (
            '{"fcc": "colwise"}',
            "",
            "7:27: error: 'fcc' is not an attribute assigned in MLP.__init__; did you mean 'fc'?"
            " (assigned there: n_head, ratio, fc, proj, wte, ln)",
        ),
        (
            '{"wte": "colwise"}',
            "",
            "7:27: error: colwise needs self.wte = nn.Linear(...) in __init__, but it is nn.Embedding(...)"
            " (supported: colwise and rowwise on nn.Linear, vocab on nn.Embedding,"
            " divide on an int attribute, replicate on anything)",
        ),
        (
            '{"ln": "rowwise"}',
            "",
            "7:27: error: rowwise needs self.ln = nn.Linear(...) in __init__, but it is nn.LayerNorm(...)"
            " (supported: colwise and rowwise on nn.Linear, vocab on nn.Embedding,"
            " divide on an int attribute, replicate on anything)",
        ),
        (
            '{"fc": "vocab"}',
            "",
            "7:27: error: vocab needs self.fc = nn.Embedding(...) in __init__, but it is nn.Linear(...)"
            " (supported: colwise and rowwise on nn.Linear, vocab on nn.Embedding,"
            " divide on an int attribute, replicate on anything)",
        ),
        (
            '{"ratio": "divide"}',
            "",
            "7:27: error: divide needs an int attribute (like n_head), but self.ratio is 0.5"
            " (supported: colwise and rowwise on nn.Linear, vocab on nn.Embedding,"
            " divide on an int attribute, replicate on anything)",
        ),
        (
            '{"fc": "divide"}',
            "",
            "7:27: error: divide needs an int attribute (like n_head), but self.fc is nn.Linear(...)"
            " (supported: colwise and rowwise on nn.Linear, vocab on nn.Embedding,"
            " divide on an int attribute, replicate on anything)",
        ),
        (
            '{"fc": "colwize"}',
            "",
            "7:33: error: unknown style 'colwize'; did you mean 'colwise'?"
            " (styles: colwise, rowwise, vocab, divide, replicate, sequence, from sequence,"
            " colwise from sequence, rowwise to sequence)",
        ),
        (
            '{"fc.weight": "colwise"}',
            "",
            "7:27: error: self.fc is nn.Linear(...), a torch layer: plan entries name whole layers ('fc'),"
            " or paths through submodules of your classes",
        ),
        (
            '{"fc": ("rowwise", 3)}',
            "",
            "7:34: error: a packed style is ('colwise', blocks): e.g. ('colwise', 3) for a fused q,"
            " k, v projection whose forward chunks its output in 3; not ('rowwise', 3)",
        ),
        (
            '{"wte": ("colwise", 3)}',
            "",
            "7:27: error: colwise needs self.wte = nn.Linear(...) in __init__, but it is nn.Embedding(...)",
        ),
        (
            '{"fc": "sequence"}',
            "",
            "7:27: error: sequence runs a layer norm or dropout on this rank's slice of the sequence,"
            " but self.fc is nn.Linear(...) (supported: nn.LayerNorm, nn.RMSNorm, nn.Dropout or a"
            " per-token module class of yours; tensor-parallel layers take 'colwise from sequence'"
            " / 'rowwise to sequence')",
        ),
        (
            '{"n_head": "sequence"}',
            "",
            "7:27: error: sequence runs a layer norm or dropout on this rank's slice of the sequence,"
            " but self.n_head is 4",
        ),
        (
            '{"fc": "from sequence"}',
            "",
            "7:27: error: 'from sequence' gathers a module's input; self.fc is an nn.Linear: plan it"
            " 'colwise from sequence' (gathered inside the layer)",
        ),
        (
            '{"ratio": "from sequence"}',
            "",
            "7:27: error: 'from sequence' needs a module (self.ratio = Attention(...)), but self.ratio is 0.5",
        ),
        (
            '{"wte": "rowwise to sequence"}',
            "",
            "7:27: error: rowwise to sequence needs self.wte = nn.Linear(...) in __init__, but it is"
            " nn.Embedding(...)",
        ),
        (
            '{"ln": "sequense"}',
            "",
            "7:33: error: unknown style 'sequense'; did you mean 'sequence'?",
        ),
        (
            '{"proj": ("rowwise to sequence", 3)}',
            "",
            "7:36: error: a packed style is ('colwise', blocks)",
        ),
        ('["fc"]', "", "7:26: error: plan must be a dict of attribute name -> style"),
        ('{"fc": "colwise"}', ", size=0", "7:50: error: size must be a positive int, not 0"),
        (
            '{"fc": "colwise"}',
            ", sise=2",
            "7:50: error: unknown argument 'sise'; did you mean 'size'? (arguments: plan, size)",
        ),
    ],
)
def test_errors_point_at_the_plan_key(plan, extra, message):
    source = "\n\n" + mlp(plan, extra)  # the decorator on line 7
    errors = expansion_errors(source)
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"test.py:{message}"), errors[0]


def test_error_cases_of_the_class_itself():
    no_init = """\
        import torch.nn as nn
        import macrogen as mg

        @mg.tensor_parallel(plan={"fc": "colwise"})
        class MLP(nn.Module):
            fc = None
        """
    assert expansion_errors(no_init) == [
        "test.py:4:27: error: MLP defines no __init__ (nor does a base class in this file):"
        " the plan names attributes that __init__ assigns (self.fc = nn.Linear(...))"
    ]
    old_super = """\
        import torch.nn as nn
        import macrogen as mg

        @mg.tensor_parallel(plan={"fc": "colwise"})
        class MLP(nn.Module):
            def __init__(self):
                super(MLP, self).__init__()
                self.fc = nn.Linear(2, 2)
        """
    assert "super(MLP, self).__init__()" in expand(old_super)  # the class keeps its name
    no_plan = """\
        import macrogen as mg

        @mg.tensor_parallel
        class MLP:
            pass
        """
    assert expansion_errors(no_plan)[0].startswith(
        "test.py:3:2: error: tensor_parallel() needs a plan"
    )
    on_function = """\
        import macrogen as mg

        @mg.tensor_parallel(plan={"fc": "colwise"})
        def f():
            pass
        """
    assert expansion_errors(on_function)[0].startswith(
        "test.py:3:2: error: tensor_parallel() decorates an nn.Module class"
    )


def test_run_time_errors_name_the_layer_and_what_is_supported(monkeypatch):
    import torch.nn as nn

    from macrogen.runtime.mesh import SERIAL, SIZE_ENV, tensor_parallel_size
    from macrogen.runtime.parallelize import PlanError, apply_tensor_parallel

    # the class path's plan is the engine's: every problem at once, each naming its layer
    model = nn.Module()
    model.fc, model.wte = nn.Conv1d(2, 2, 1), nn.Embedding(8, 4, max_norm=1.0)
    model.qkv, model.ratio, model.n_head = nn.Linear(4, 10), 0.5, 6
    plan = {"fc": "colwise", "wte": "vocab", "qkv": ("colwise", 3), "ratio": "divide"}
    with pytest.raises(PlanError) as e:
        apply_tensor_parallel(model, SERIAL, plan, where="test")
    assert str(e.value).splitlines() == [
        "fc: colwise needs an nn.Linear (or a subclass) or an HF Conv1D, not Conv1d (vocab:"
        " nn.Embedding; divide: an int attribute)",
        "wte: vocab supports nn.Embedding without max_norm, scale_grad_by_freq, sparse",
        "qkv: 10 out features in 3 blocks are not divisible by tp=1",
        "ratio: divide needs an int attribute, not float",
    ]
    apply_tensor_parallel(model, SERIAL, {"n_head": "divide"}, where="test")
    assert model.n_head == 6  # serial: nothing divided

    monkeypatch.delenv(SIZE_ENV, raising=False)
    assert tensor_parallel_size(None, 4) == 1  # asked for, never implied by the world size
    assert tensor_parallel_size(2, 4) == 2
    monkeypatch.setenv(SIZE_ENV, "4")
    assert tensor_parallel_size(None, 8) == 4
    with pytest.raises(
        ValueError, match=r"tensor-parallel size 4 does not divide the world size 6"
    ):
        tensor_parallel_size(None, 6)
    monkeypatch.setenv(SIZE_ENV, "two")
    with pytest.raises(ValueError, match=r"MACROGEN_TP_SIZE='two': expected a whole number >= 1"):
        tensor_parallel_size(None, 2)


def test_sizes_of_a_sequence_slice_fed_to_colwise_from_sequence_are_an_error():
    # x is this rank's slice of the sequence: T would be T / tp while the layer's output is whole
    source = """\
        import torch.nn as nn
        import macrogen as mg


        @mg.tensor_parallel(plan={"qkv": "colwise from sequence", "proj": "rowwise to sequence"})
        class Attention(nn.Module):
            def __init__(self, d):
                super().__init__()
                self.qkv = nn.Linear(d, 3 * d)
                self.proj = nn.Linear(d, d)

            def forward(self, x):
                B, T, C = x.size()
                return self.proj(self.qkv(x).view(B, T, 3, -1).sum(2))
        """
    assert expansion_errors(source) == [
        "test.py:13:19: error: x reaches a 'colwise from sequence' layer, so it is this rank's slice"
        " of the sequence: its .size gives T / tp where that layer's output has the whole sequence;"
        " plan the layer 'colwise' and this module 'from sequence' in its parent (its input is then"
        " gathered on entry)"
    ]


def test_sequence_styles_render_their_runtime_styles():
    code = expand(
        mlp('{"fc": ("colwise from sequence", 2), "proj": "rowwise to sequence", "ln": "sequence"}')
    )
    assert "'fc': ('colwise_from_sequence', 2)," in code
    assert "'proj': 'rowwise_to_sequence'," in code
    assert "'ln': 'sequence_slice'," in code


def test_only_an_undecorated_builder_that_re_initializes_gets_the_plan_less_decorator():
    code = expand(
        """\
        import torch.nn as nn
        import macrogen as mg


        @mg.tensor_parallel(plan={"fc": "colwise"})
        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 8)


        class Block(nn.Module):  # builds it, re-initializes nothing
            def __init__(self):
                super().__init__()
                self.mlp = MLP()


        class Model(nn.Module):  # builds it (through Block) and re-initializes
            def __init__(self):
                super().__init__()
                self.block = Block()
                self.apply(lambda m: None)


        @mg.tensor_parallel(plan={})
        class Decorated(nn.Module):  # a root already
            def __init__(self):
                super().__init__()
                self.mlp = MLP()
                self.apply(lambda m: None)


        class Derived(Decorated):  # derived from a root: its __init__ is wrapped already
            def __init__(self):
                super().__init__()
                self.more = MLP()
                self.apply(lambda m: None)
        """
    )
    assert "@tensor_parallel_class('Model', None, {})\nclass Model(nn.Module):" in code
    for name in ("Block", "Derived"):
        assert f"tensor_parallel_class('{name}'" not in code, name
    assert code.count("tensor_parallel_class('Decorated'") == 1
