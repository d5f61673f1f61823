import pytest

from tests.trainer.cli_helpers import one_thread  # noqa: F401 - the fixture used below


@pytest.fixture(autouse=True)
def _one_thread(one_thread):  # noqa: F811
    yield
