import os
from pathlib import Path

import pytest

# Generated code must not depend on the hash seed; tests also run under others.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Files whose tests spawn processes (gloo ranks, torchrun, the Triton interpreter, a wheel
# build, ptxas) or run numerics over many cases:
# slow by name, so a new distributed test file is in the slow tier without a marker.
_SLOW_FILES = ("_dist.py", "_processes.py", "_ranks.py", "_parity.py")
_SLOW_NAMES = ("test_wheel.py", "test_tile_compile.py")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-goldens",
        action="store_true",
        help="rewrite tests/golden/*/expected.* from the current output",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        name = Path(str(item.fspath)).name
        if name.endswith(_SLOW_FILES) or name in _SLOW_NAMES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def update_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-goldens"))
