import inspect
import os
import re
from pathlib import Path

import pytest

from tests import background

# Generated code must not depend on the hash seed; tests also run under others.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Files whose tests spawn processes (gloo ranks, torchrun, the Triton interpreter, a wheel
# build, ptxas) or run numerics over many cases:
# slow by name, so a new distributed test file is in the slow tier without a marker.
_SLOW_FILES = ("_dist.py", "_processes.py", "_ranks.py", "_parity.py")
_SLOW_NAMES = ("test_wheel.py", "test_tile_compile.py")
# A test whose own code starts processes is slow wherever it lives.
_SPAWNS = re.compile(r"\b(run_ranks|run_interpreted|subprocess\.\w+|mp\.spawn)\(")

# The extended tier: slow tests whose ground a cheaper test of the default run covers, kept
# out of plain `pytest` (and CI, which must stay under 20 minutes on 2 cores) and run with
# `pytest --extended`. Each entry says what covers it in the default run.
EXTENDED = {
    # 4 ranks (data x tensor) compiled: tp-2 and test_compile_kinds_dist's data x tensor cover it
    "tests/test_compile_dist.py::test_compiled_training_equals_eager[tp-4-aot_eager]",
    # blocks compiled under tensor parallelism: tp-2 compiles the same tensor-parallel model
    # whole, dp_blocks and fsdp_blocks compile each block
    "tests/test_compile_dist.py::test_compiled_training_equals_eager[tp_blocks-2-aot_eager]",
    # sequence parallelism compiled per sublayer: the whole model compiled traces the same
    # collectives, and the *_blocks cases of test_compile_dist compile per block
    "tests/test_compile_kinds_dist.py::test_sequence_parallel_compiled_equals_eager[per_sublayer]",
    # layout="auto" on 4 ranks (~50 s): the 2-rank run searches, stops early, times the
    # finalists and remembers the same way; tests/test_layouts.py checks the 4-rank space
    "tests/test_layout_autotune_dist.py::test_layout_auto_on_gloo_ranks[four]",
    # Inductor's CPU codegen (~60 s): the aot_eager cases capture the same graphs
    "tests/test_compile_dist.py::test_compiled_training_equals_eager[dp-2-inductor]",
    # a rank of 4 killed: test_kill_one_of_2_ranks[seed0] kills and resumes the same way
    "tests/test_checkpoint_elastic.py::test_kill_one_of_4_ranks",
    # killed mid-save: the half-written folder is skipped as in test_checkpoint.py's truncated
    # and unmarked checkpoints, and the parameter server's kill-and-resume run
    "tests/test_checkpoint_elastic.py::test_kill_one_of_2_ranks[during-save]",
    # FSDP killed and resumed: test_checkpoint_fsdp_dist resumes FSDP exactly, the elastic
    # test kills and resumes
    "tests/test_fsdp_rest_dist.py::test_fsdp_killed_rank_resumes_bit_identical",
    # ZeRO-1 over tensor-parallel shards under torch.compile (aot_eager, ~40 s under load): the
    # eager cases of the same program check the sharded step, test_compile_dist's tp-2 the
    # compiled tensor-parallel model
    "tests/test_zero_tensor_dist.py::test_zero1_over_tensor_parallel_shards_equals_serial[compiled]",
    # 8 ranks (pipeline x data x tensor): the 4-rank pp x tp and pp x dp tests cover each pair
    "tests/test_parallelize_pipeline_tp_dist.py::"
    "test_pp2_by_dp2_by_tp2_on_eight_ranks_equals_the_serial_program",
    # the GPU bench's every row on CPU: test_the_gpu_sessions_script_runs_its_steps_and_logs_each
    # runs its steps, tests/test_parallelize_dist.py trains with the foreach step
    "tests/test_bench_gpu.py::test_dry_run_checks_every_row_and_exits_zero",
    "tests/test_bench_gpu.py::test_training_rows_run_with_cudas_foreach_optimizer_step",
    # the session script's attention step, dry (~10 s): the session script's own test runs
    # the script, tests/macros/test_tile_parity.py the attention kernels (run it before a
    # GPU session: `pytest --extended tests/test_bench_gpu.py`)
    "tests/test_bench_gpu.py::test_the_gpu_sessions_attention_step_runs_the_sdpa_comparison",
    # pipelines of meta-built models in every combination of layout, init and folder kind:
    # the default run's pp=2 (Llama, Qwen2's tied weight, both inits), pp=2 x tp=2 and
    # pp=2 x FSDP 2 cases of the same program cover each step
    "tests/test_meta_load_dist.py::"
    "test_meta_pipelines_in_every_combination_equal_the_serial_program",
    # the Llama's pipelined checkpoints resumed on 4 ranks (pp=2 x 2 replicas, x tp=2, x FSDP 2,
    # x ZeRO-1) and as pp=1 on 2, its own checkpoints again, a serial one as pp=2, the GPT
    # interleaved (4 stages on 2 ranks) stopped and resumed: the default run's stop-and-resume
    # (Llama and GPT on 2 ranks), the GPT's resumes on 4 ranks and serially (and its own
    # checkpoints again) and the Llama's serially cover each step
    "tests/test_meta_checkpoint_dist.py::"
    "test_pipelines_resume_under_tensor_parallel_fsdp_and_without_stages",
    # peak RSS of a 306 MB model built on meta and loaded on 4 ranks: bench/meta_memory.py
    # measures it (docs/parallelize.md's table); test_meta_load_dist loads the same way
    "tests/test_meta_memory_dist.py::"
    "test_meta_build_and_load_peaks_at_the_share_plus_one_layer[meta]",
    "tests/test_meta_memory_dist.py::"
    "test_meta_build_and_load_peaks_at_the_share_plus_one_layer[meta_pp]",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-goldens",
        action="store_true",
        help="rewrite tests/golden/*/expected.* from the current output",
    )
    parser.addoption(
        "--extended",
        action="store_true",
        help="also run the extended tier (tests/conftest.py's EXTENDED: slow, covered elsewhere)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = Path(str(item.fspath)).name
        if name.endswith(_SLOW_FILES) or name in _SLOW_NAMES or _spawns(item):
            item.add_marker(pytest.mark.slow)
    if not config.getoption("--extended"):
        extended = [item for item in items if item.nodeid in EXTENDED]
        if extended:
            config.hook.pytest_deselected(items=extended)
            items[:] = [item for item in items if item.nodeid not in EXTENDED]
    # the interpreter runs these files read start now, on the core the tests leave idle, and
    # the files run last: by then the runs are done and no test waits for one (a file that ran
    # first waited ~50 s with one core idle)
    if not config.option.collectonly:
        background.start_for({Path(str(item.fspath)).name for item in items})
    readers = background.reader_files()
    items.sort(key=lambda item: Path(str(item.fspath)).name in readers)  # stable: order kept


def pytest_sessionfinish(session: pytest.Session) -> None:
    background.stop_all()


def _spawns(item: pytest.Item) -> bool:
    function = getattr(item, "function", None)
    try:
        return function is not None and bool(_SPAWNS.search(inspect.getsource(function)))
    except (OSError, TypeError):
        return False


@pytest.fixture
def update_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-goldens"))
