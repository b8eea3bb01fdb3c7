"""``mg.parallelize``: parallelism applied to a built model, one named step at a time, on one mesh.

    model = LlamaForCausalLM(config)                       # any library, any constructor
    model = mg.parallelize(model, tp=2, tp_plan="hf", dp="replicate")

expands to a call of a generated function that runs, in torchtitan's order:

    parallelize_once(model, where=...)                     # a second mg.parallelize: an error
    mesh = device_mesh(tp=2, where=...)                    # one DeviceMesh, agreed by all ranks
    apply_tensor_parallel(model, mesh, plan, where=...)    # shards as DTensors, local forward
    apply_data_parallel(model, mesh, "replicate", where=...)

The model object keeps its class and identity (registries, ``isinstance`` and
``Config.build()`` see the user's classes), and nothing is deferred: the model is
built when it is handed over, so a parent's re-initialization has already run and
each rank cuts its shard of the serial weights. Each planned layer runs its own
forward on its local shards, with its style's collectives around it.

    plan      the plan as written, transformers' plan (``hf_plan``), path matching
    layout    the plan resolved: cuts, summed gradients, divisions, wrapped forwards
    styles    each style's forward around the layer's own
    local     local tensors in the parameters' places while a forward runs
    checks    the probe of custom forwards, the replicated-gradient check, sharded outputs
    engine    ``apply_tensor_parallel``: the steps above, in order
    steps     the mesh, applied-once, data parallel
"""

from macrogen.runtime.parallelize.engine import apply_tensor_parallel, check_outputs
from macrogen.runtime.parallelize.local import (
    COLWISE,
    is_tensor_parallel,
    local_forward_per_unit,
    local_parameters,
    weakly_bound,
)
from macrogen.runtime.parallelize.plan import (
    PlanError,
    Style,
    hf_plan,
    layer_kind,
    matches,
    path_pattern,
)
from macrogen.runtime.parallelize.steps import (
    apply_data_parallel,
    device_mesh,
    no_data_parallel,
    parallelize_once,
)
from macrogen.runtime.parallelize.styles import LAST_OUTPUT

# the names other runtime modules, the autotuner's probe and the pipeline's tests use
_matches = matches
_kind = layer_kind
_COLWISE = COLWISE
_LAST_OUTPUT = LAST_OUTPUT

__all__ = [
    "PlanError",
    "Style",
    "apply_data_parallel",
    "apply_tensor_parallel",
    "check_outputs",
    "device_mesh",
    "hf_plan",
    "is_tensor_parallel",
    "layer_kind",
    "local_forward_per_unit",
    "local_parameters",
    "matches",
    "no_data_parallel",
    "parallelize_once",
    "path_pattern",
    "weakly_bound",
]
