import inspect
import os
import re
from pathlib import Path

import pytest

# Generated code must not depend on the hash seed; tests also run under others.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Files whose tests spawn processes (gloo ranks, torchrun, the Triton interpreter, a wheel
# build, ptxas) or run numerics over many cases:
# slow by name, so a new distributed test file is in the slow tier without a marker.
_SLOW_FILES = ("_dist.py", "_processes.py", "_ranks.py", "_parity.py")
_SLOW_NAMES = ("test_wheel.py", "test_tile_compile.py")
# A test whose own code starts processes is slow wherever it lives.
_SPAWNS = re.compile(r"\b(run_ranks|run_interpreted|subprocess\.\w+|mp\.spawn)\(")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-goldens",
        action="store_true",
        help="rewrite tests/golden/*/expected.* from the current output",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = Path(str(item.fspath)).name
        if name.endswith(_SLOW_FILES) or name in _SLOW_NAMES or _spawns(item):
            item.add_marker(pytest.mark.slow)


def _spawns(item: pytest.Item) -> bool:
    function = getattr(item, "function", None)
    try:
        return function is not None and bool(_SPAWNS.search(inspect.getsource(function)))
    except (OSError, TypeError):
        return False


@pytest.fixture
def update_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-goldens"))
