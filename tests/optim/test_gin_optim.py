"""Every gin/optim file parses and builds its balancer (the test may import gin)."""

import pathlib

import gin
import optax
import pytest

GIN_DIR = pathlib.Path(__file__).resolve().parents[2] / "gin"
FILES = sorted((GIN_DIR / "optim").glob("*.gin"))


def test_there_is_a_file_per_method():
    import ktx.optim as ko

    names = {f.stem for f in FILES}
    assert set(ko.BALANCERS) <= names


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_gin_file_builds_balancer(path):
    gin.clear_config()
    gin.add_config_file_search_path(str(GIN_DIR))
    try:
        gin.parse_config("NUM_TASKS = 3")  # the model file's macro
        gin.parse_config_file(str(path))
        balancer = gin.query_parameter("%BALANCER").scoped_configurable_fn()
        assert isinstance(balancer, optax.GradientTransformation)
        if path.stem == "metabalance_reduce":
            assert gin.query_parameter("ktx.optim.metabalance.strategy") == "reduce"
    finally:
        gin.clear_config()
