"""float8 training (parallel.float8) on the CPU: which layers torchao converts, that checkpoints keep their
names, the decisions before launch, and a converted model's step in torchao's emulation against the same step
in fp32. The float8 matmuls themselves need a GPU of capability 8.9 (tests/gpu/test_on_cuda.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from paratrain.config.schema import Float8Config
from paratrain.errors import ConfigError
from paratrain.models.gpt import build_gpt
from paratrain.parallel.float8 import (
    apply_float8_training,
    check_float8_device,
    float8_linear_paths,
    gathers_in_float8,
)
from paratrain.tensors import plain_tensor

pytest.importorskip("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402 - after the skip: torchao is an optional extra
from torchao.float8.float8_training_tensor import LinearMMConfig  # noqa: E402
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

PROJECTIONS = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj", "mlp.up_proj", "mlp.down_proj")
EMULATED = Float8Config(enabled=True, emulate=True)


def tiny_gpt(n_embd: int = 32) -> nn.Module:
    torch.manual_seed(0)
    return build_gpt(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=n_embd)


def convert(model: nn.Module, options: Float8Config = EMULATED, *, fsdp: bool = False) -> nn.Module:
    apply_float8_training(model, plan=model.parallel_plan(), options=options, fsdp=fsdp, compile=False)
    return model


def test_float8_converts_the_blocks_projections_and_leaves_embedding_head_and_names_alone():
    model = tiny_gpt()
    names_before = list(model.state_dict())
    convert(model)
    converted = sorted(path for path, module in model.named_modules() if isinstance(module, Float8Linear))
    assert converted == sorted(f"blocks.{i}.{layer}" for i in range(2) for layer in PROJECTIONS)
    assert type(model.lm_head) is nn.Linear  # the loss reads the head's logits: kept in the compute dtype
    assert list(model.state_dict()) == names_before  # checkpoints move between float8 and bf16 runs


def test_a_layer_whose_sizes_are_not_multiples_of_16_stays_in_the_compute_dtype():
    narrow = tiny_gpt(n_embd=24)  # 24 x 24 attention, 96 x 24 MLP: no float8 matmul takes them
    assert float8_linear_paths(narrow, narrow.parallel_plan()) == []
    convert(narrow)
    assert not any(isinstance(module, Float8Linear) for module in narrow.modules())


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_an_emulated_float8_step_stays_close_to_the_same_step_in_full_precision(scaling):
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    exact, float8 = tiny_gpt(), convert(tiny_gpt(), Float8Config(enabled=True, emulate=True, scaling=scaling))
    losses, gradients = [], []
    for model in (exact, float8):
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
        losses.append(loss.item())
        gradients.append(torch.cat([param.grad.flatten() for param in model.parameters()]))
    # e4m3 keeps 3 mantissa bits: every converted matmul's inputs move by up to 1/16 of themselves,
    # which a 2-layer model's loss feels at the 1e-3 level; a wrong scale would be off by far more.
    assert losses[1] == pytest.approx(losses[0], rel=1e-2)
    assert losses[1] != losses[0], "the converted layers computed in full precision"
    assert nn.functional.cosine_similarity(gradients[0], gradients[1], dim=0) > 0.99


def test_tensorwise_weights_are_gathered_in_float8_under_fsdp_and_rowwise_ones_are_not():
    tensorwise, rowwise = Float8Config(enabled=True), Float8Config(enabled=True, scaling="rowwise")
    assert gathers_in_float8(tensorwise, fsdp=True)
    assert not gathers_in_float8(tensorwise, fsdp=False)
    assert not gathers_in_float8(rowwise, fsdp=True)  # one scale per row: torchao gathers no such weight
    assert not gathers_in_float8(tensorwise, fsdp=True, tp=2)  # a scale per tp shard: not one process's numbers
    assert not gathers_in_float8(Float8Config(enabled=True, fsdp_float8_all_gather=False), fsdp=True)
    model = convert(tiny_gpt(), Float8Config(enabled=True, emulate=True), fsdp=True)
    assert model.blocks[0].attn.q_proj.config.enable_fsdp_float8_all_gather
    model = convert(tiny_gpt(), Float8Config(enabled=True, emulate=True, scaling="rowwise"), fsdp=True)
    assert not model.blocks[0].attn.q_proj.config.enable_fsdp_float8_all_gather


@pytest.mark.parametrize(
    "device_type, capability, refusal",
    [
        ("cpu", None, "needs a CUDA GPU of compute capability 8.9 or newer .* this run trains on the CPU"),
        ("cuda", (8, 0), "this run's GPU, NVIDIA A100, has compute capability 8.0"),
        ("cuda", (8, 6), "has compute capability 8.6"),
        ("cuda", (8, 9), None),
        ("cuda", (9, 0), None),
        ("cuda", (10, 0), None),
    ],
)
def test_float8_needs_a_gpu_of_capability_8_9_or_newer_unless_emulated(device_type, capability, refusal):
    facts = {"device_type": device_type, "capability": capability, "gpu_name": "NVIDIA A100"}
    check_float8_device(**facts, emulate=True)  # emulation runs anywhere
    if refusal is None:
        check_float8_device(**facts, emulate=False)
        return
    with pytest.raises(ConfigError, match=f"{refusal}.*parallel.float8.emulate=true"):
        check_float8_device(**facts, emulate=False)


LOAD_WITHOUT_TORCHAO = """
import sys, torch
for path in sys.argv[1:]:
    try:
        torch.load(path, weights_only=True)  # as DCP reads a checkpoint's tensors
        print("loaded")
    except Exception as error:
        print(type(error).__name__)
"""


def test_a_weight_fsdp_gathers_in_float8_is_checkpointed_as_the_plain_tensor_it_wraps(tmp_path):
    hp = torch.randn(32, 16)
    wrapped = WeightWithDynamicFloat8CastTensor(hp, LinearMMConfig(), torch.float8_e4m3fn)
    plain = plain_tensor(wrapped)
    assert type(plain) is torch.Tensor and plain.data_ptr() == hp.data_ptr()  # a load into it lands in the weight
    assert plain_tensor(hp) is hp
    torch.save({"weight": wrapped}, tmp_path / "wrapped.pt")
    torch.save({"weight": plain}, tmp_path / "plain.pt")
    # Where torchao is not imported (a bf16 run resuming, `paratrain export`), the wrapper's class is unknown.
    loads = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_TORCHAO, str(tmp_path / "wrapped.pt"), str(tmp_path / "plain.pt")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert loads.stdout.split() == ["UnpicklingError", "loaded"]
