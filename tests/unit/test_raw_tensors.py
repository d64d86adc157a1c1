"""Plain tensors are written as raw bytes and read back without torch.load: every dtype and shape a state holds
comes back exact, through a resume's load and an export's reader alike, and torch's own reader refuses such
an item instead of misreading it. Equal non-tensor values are serialized once, into the bytes torch.save writes."""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

from paratrain.checkpoint import Checkpointer
from paratrain.checkpoint.raw_tensors import RAW
from paratrain.checkpoint.safe_reader import SafeFileSystemReader
from paratrain.checkpoint.tensor_reader import TensorReader
from paratrain.parallel.collectives import quiet_single_process


@dataclass
class Tensors(Stateful):
    values: dict[str, Any]

    def state_dict(self) -> dict[str, Any]:
        return self.values

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.values = dict(state_dict)


def odd_tensors() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "bf16": torch.randn(5, 7).to(torch.bfloat16),
        "fp16": torch.randn(3).half(),
        "int64": torch.arange(11),
        "bool": torch.rand(4, 4) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "transposed": torch.randn(6, 4).t(),  # not contiguous
        "view_into_larger": torch.randn(100)[10:17],  # storage larger than the tensor
        "complex": torch.randn(3, dtype=torch.complex64),
        "step": 7,
    }


def save(tmp_path: Path, values: dict[str, Any]) -> Path:
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep_last=None, rank=0, world_size=1, config={})
    return checkpointer.save(1, {"own": Tensors(values)})


def blank_like(values: dict[str, Any]) -> dict[str, Any]:
    return {key: torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0 for key, value in values.items()}


def assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert actual[key].dtype == value.dtype and torch.equal(actual[key], value), key
        else:
            assert actual[key] == value, key


def test_every_plain_tensor_is_stored_raw_and_loads_back_exact(tmp_path):
    values = odd_tensors()
    path = save(tmp_path, values)
    stored = SafeFileSystemReader(path).read_metadata().storage_data
    raw = {index.fqn for index, info in stored.items() if RAW in (info.transform_descriptors or ())}
    assert raw == {f"own.{key}" for key, value in values.items() if isinstance(value, torch.Tensor)}
    assert all(info.offset % 64 == 0 for index, info in stored.items() if index.fqn in raw)

    into = Tensors(blank_like(values))
    Checkpointer(tmp_path / "checkpoints", keep_last=None, rank=0, world_size=1, config={}).load(path, {"own": into})
    assert_same(into.values, values)


def test_an_exports_reader_reads_raw_tensors_exact(tmp_path):
    values = odd_tensors()
    path = save(tmp_path, values)
    tensors = {key: value for key, value in values.items() if isinstance(value, torch.Tensor)}
    with TensorReader(path) as reader:
        read = reader.read_all(f"own.{key}" for key in tensors)
    assert_same({key.removeprefix("own."): value for key, value in read.items()}, tensors)


def test_torchs_own_reader_refuses_a_raw_tensor_instead_of_misreading_it(tmp_path):
    path = save(tmp_path, {"weight": torch.randn(4, 4)})
    with pytest.raises(BaseException, match="Unknown extension.*paratrain.raw_tensor"), quiet_single_process():
        dcp.load({"own": Tensors({"weight": torch.zeros(4, 4)})}, checkpoint_id=path, no_dist=True)


def test_equal_values_are_serialized_once_and_written_as_torch_save_writes_each(tmp_path):
    values = {"lr": 1e-3, "again_lr": 1e-3, "other_lr": 2e-3, "name": "adamw", "amsgrad": False}
    path = save(tmp_path, values)
    for index, info in SafeFileSystemReader(path).read_metadata().storage_data.items():
        written = (path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        expected = io.BytesIO()
        torch.save(values[index.fqn.removeprefix("own.")], expected)
        assert written == expected.getvalue(), index.fqn
    into = Tensors(dict.fromkeys(values, 0))
    Checkpointer(tmp_path / "checkpoints", keep_last=None, rank=0, world_size=1, config={}).load(path, {"own": into})
    assert_same(into.values, values)
