import os

import pytest

# Generated code must not depend on the hash seed; tests also run under others.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-goldens",
        action="store_true",
        help="rewrite tests/golden/*/expected.* from the current output",
    )


@pytest.fixture
def update_goldens(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-goldens"))
