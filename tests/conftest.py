import os

# Before jax is imported anywhere: the sharding tests need 8 CPU devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import pytest  # noqa: E402
from _util import gpu_available  # noqa: E402 (imports jax)

NO_GPU = "needs a GPU and the jax_kimi_mla CUDA module"


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a GPU with the CUDA module (large or GPU-only cases)")


def pytest_runtest_setup(item):
    if item.get_closest_marker("cuda") is not None and not gpu_available():
        pytest.skip(NO_GPU)


@pytest.fixture(params=["cpu", "cuda"])
def backend(request) -> str:
    """The platform the op runs on: inputs are put on ``jax.devices(backend)[0]``."""
    if request.param == "cuda" and not gpu_available():
        pytest.skip(NO_GPU)
    return request.param
