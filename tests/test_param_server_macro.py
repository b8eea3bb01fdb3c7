"""``mg.parallelize(model, servers=S, tp_plan={"path": "server"})``: the expansion and its checks
(the runtime and an expanded program on ranks: tests/test_param_server_dist.py)."""

from __future__ import annotations

import pytest

from tests.helpers import expand, expansion_errors


def test_server_entries_expand_to_the_server_step_then_workers_data_parallel():
    code = expand(
        """
        import macrogen as mg

        model = mg.parallelize(build(), servers=2, tp_plan={"emb": "server", "tags": "server"},
                               staleness=1, server_optimizer="adagrad", server_lr=0.05)
        """
    )
    assert "apply_server_tables(model, ['emb', 'tags'], ServerConfig(" in code
    for setting in ("servers=2,", "staleness=1,", "optimizer='adagrad',", "lr=0.05,"):
        assert setting in code
    assert "data_parallel=DataParallelConfig(" in code  # the dense rest, among the workers
    assert "apply_tensor_parallel" not in code and "apply_data_parallel" not in code
    assert "device_mesh(tp=1, pp=1, planned=False" in code  # no tensor-parallel warning
    compile(code, "test.py", "exec")


def test_dp_none_leaves_the_dense_part_alone():
    code = expand(
        "import macrogen as mg\nm = mg.parallelize(m, servers=1, tp_plan={'e': 'server'}, dp='none')\n"
    )
    assert "data_parallel=" not in code and "apply_server_tables(model, ['e']" in code


@pytest.mark.parametrize(
    "call,message",
    [
        ("mg.parallelize(m, tp_plan={'e': 'server'})", "pass servers=S"),
        ("mg.parallelize(m, servers=2)", "servers=2 needs tables to serve"),
        ("mg.parallelize(m, staleness=2)", "staleness applies with servers=S > 0"),
        ("mg.parallelize(m, servers=-1, tp_plan={'e': 'server'})", "servers must be an int >= 0"),
        (
            "mg.parallelize(m, servers=1, tp_plan={'e': 'server'}, server_optimizer='adam')",
            'server_optimizer must be "sgd" or "adagrad"',
        ),
        (
            "mg.parallelize(m, servers=1, tp=2, tp_plan={'e': 'server', 'q': 'colwise'})",
            "tensor parallelism is not supported yet",
        ),
        (
            "mg.parallelize(m, servers=1, tp_plan={'e': 'server'}, dp='zero1')",
            'takes dp="replicate" or "none"',
        ),
        (
            "mg.parallelize(m, servers=1, tp_plan={'e': 'server'}, accumulate=2)",
            "takes accumulate=1",
        ),
        ("mg.parallelize(m, servers=1, tp_plan={'e': 'sever'})", "did you mean 'server'?"),
    ],
)
def test_server_argument_errors(call, message):
    errors = expansion_errors(f"import macrogen as mg\nm = {call}\n")
    assert len(errors) == 1 and message in errors[0], errors


SERIAL = """
import torch.nn as nn
import macrogen as mg


def table():
    model = nn.Sequential(nn.Embedding(50, 4), nn.Linear(4, 1))
    return mg.parallelize(model, servers=1, tp_plan={"0": "server"}, server_lr=0.1)


def linear():
    model = nn.Sequential(nn.Embedding(50, 4), nn.Linear(4, 1))
    return mg.parallelize(model, servers=1, tp_plan={"1": "server"})


def missing():
    model = nn.Sequential(nn.Embedding(50, 4), nn.Linear(4, 1))
    return mg.parallelize(model, servers=1, tp_plan={"emb": "server"})
"""


def test_run_serially_the_table_stays_and_the_plan_is_checked(tmp_path):
    from macrogen.runtime.param_server import ServerPlanError
    from tests.helpers import load_module

    module = load_module(expand(SERIAL), "param_server_serial", tmp_path)
    model = module.table()  # world size 1: the serial model, the table in it
    assert model[0].weight.shape == (50, 4) and "forward" not in vars(model[0])
    with pytest.raises(ServerPlanError, match="1: server needs an nn.Embedding or nn.EmbeddingBag"):
        module.linear()
    with pytest.raises(ServerPlanError, match="emb: matches nothing"):
        module.missing()


def test_data_parallel_servers_expand_to_the_server_step():
    code = expand(
        """
        import macrogen as mg

        @mg.data_parallel(servers=2, server_plan=["emb"], staleness=1, server_optimizer="adagrad")
        class Rec(nn.Module):
            pass
        """
    )
    # the class's decorator hands the tables to apply_server_tables, which makes the
    # workers' GradientSync (class_macros.data_parallel_class)
    assert "servers=(['emb'], ServerConfig(" in code
    assert "staleness=1," in code and "optimizer='adagrad'," in code
    compile(code, "test.py", "exec")


@pytest.mark.parametrize(
    "args,message",
    [
        ("servers=1", "servers=1 needs the tables to serve"),
        ("server_plan=['emb']", "server_plan applies with servers=S > 0"),
        ("servers=1, server_plan=['emb'], sync_every=4", "servers=S takes neither local SGD"),
        ("servers=1, server_plan={'emb': 'colwise'}", "server_plan must be None or a list"),
    ],
)
def test_data_parallel_server_errors(args, message):
    errors = expansion_errors(
        f"import macrogen as mg\n@mg.data_parallel({args})\nclass M(nn.Module):\n    pass\n"
    )
    assert len(errors) == 1 and message in errors[0], errors
