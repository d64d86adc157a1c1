from __future__ import annotations

import pytest

from paratrain.config.factories import call_factory, resolve_factory
from paratrain.config.schema import ModelConfig
from paratrain.errors import ConfigError


def test_factory_is_imported_and_called_with_its_args():
    model = call_factory(ModelConfig(factory="paratrain.models.mlp:build_mlp", args={"in_features": 5}), key="model")
    assert model.layers[0][0].in_features == 5


@pytest.mark.parametrize(
    "path,message",
    [
        ("paratrain.models.mlp", "must look like 'package.module:callable'"),
        ("paratrain.models.mlp:nothing_here", "has no callable 'nothing_here'"),
        ("paratrain.nowhere:build", "does not import"),
    ],
)
def test_bad_factory_paths_name_the_key(path, message):
    with pytest.raises(ConfigError, match=message) as error:
        resolve_factory(path, key="model.factory")
    assert str(error.value).startswith("model.factory=")
