"""Exports read only what they write, and check only the files they read, as they read them: the model's
entries are written apart from the optimizer's (a damaged optimizer file stops no export), a LoRA adapter
export reads no base weight, and the merged export streams into shards that transformers loads, with
peft's own merged values. A checkpoint written before the split still exports, every file it reads checked."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from paratrain.checkpoint import Checkpointer
from paratrain.checkpoint.file_groups import file_group
from paratrain.checkpoint.manifest import DamagedCheckpointError, write_manifest
from paratrain.checkpoint.safe_reader import SafeFileSystemReader
from paratrain.checkpoint.state import ModelState, OptimizerState, Progress
from paratrain.checkpoint.tensor_reader import TensorReader
from paratrain.config.schema import LoraConfig
from paratrain.models.lora import apply_lora, peft_config
from paratrain.parallel.collectives import quiet_single_process
from paratrain.tools.export import export_hf, export_newest_hf, export_safetensors

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")

LLAMA = dict(
    model_type="llama",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
LORA = {"r": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj", "down_proj"]}


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    fields = {key: value for key, value in LLAMA.items() if key != "model_type"}
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model("llama", **fields))


def with_trained_adapters(model: torch.nn.Module) -> torch.nn.Module:
    """The model with LoRA injected and its adapters moved off their initial values (B starts at zero)."""
    adapted = apply_lora(model, LoraConfig(**LORA))
    with torch.no_grad():
        for name, parameter in adapted.named_parameters():
            if ".lora_" in name:
                parameter.normal_(std=0.1)
    return adapted


def training_state(model: torch.nn.Module, step: int = 1) -> dict:
    """Model, optimizer (one step taken: moments saved) and step, as a run saves them."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    model(torch.arange(8).view(1, 8)).logits.sum().backward()
    optimizer.step()
    return {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer), "progress": Progress(step)}


def run_config(*, lora: bool) -> dict:
    return {"model": {"factory": "paratrain.models.hf:causal_lm", "args": LLAMA, "lora": LORA if lora else None}}


def save(tmp_path: Path, model: torch.nn.Module, *, lora: bool) -> Path:
    config = run_config(lora=lora)
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep_last=None, rank=0, world_size=1, config=config)
    return checkpointer.save(1, training_state(model))


def save_in_the_old_layout(tmp_path: Path, model: torch.nn.Module) -> Path:
    """As checkpoints were written before the model had files of its own: DCP's split by size alone."""
    path = tmp_path / "checkpoints" / "step-1"
    with quiet_single_process():
        dcp.save(training_state(model), storage_writer=dcp.FileSystemWriter(path, thread_count=2), no_dist=True)
    write_manifest(path, step=1, config=run_config(lora=False), world_size=1)
    return path


def keys_by_file(checkpoint: Path) -> dict[Path, set[str]]:
    storage = SafeFileSystemReader(checkpoint).read_metadata().storage_data
    files: dict[Path, set[str]] = {}
    for index, stored in storage.items():
        files.setdefault(checkpoint / stored.relative_path, set()).add(index.fqn)
    return files


def files_holding_only(checkpoint: Path, group: str) -> list[Path]:
    return sorted(file for file, keys in keys_by_file(checkpoint).items() if {file_group(k) for k in keys} == {group})


def flip_a_byte(path: Path) -> Path:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different checksum
    path.write_bytes(bytes(data))
    return path


def model_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def test_an_adapter_export_reads_no_base_weight(tmp_path):
    model = with_trained_adapters(llama())
    checkpoint = save(tmp_path, model, lora=True)
    base_only = files_holding_only(checkpoint, "model")
    assert base_only, "the base weights should have files of their own"
    for file in base_only:
        flip_a_byte(file)

    assert export_hf(checkpoint, tmp_path / "adapter") == 2 * 3 * 2  # A and B, 3 targets, 2 layers
    written = safetensors_torch.load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            assert torch.equal(written["base_model.model." + name.replace(".default.", ".")], tensor), name
    damaged = "|".join(re.escape(str(file)) for file in base_only)
    with pytest.raises(DamagedCheckpointError, match=f"checkpoint file ({damaged}) is corrupt"):
        export_hf(checkpoint, tmp_path / "merged", merge=True)  # reads the base: finds the damage


def test_the_reader_opens_only_the_files_holding_the_tensors_asked_for(tmp_path):
    checkpoint = save(tmp_path, with_trained_adapters(llama()), lora=True)
    with TensorReader(checkpoint) as reader:
        reader.read_all(key for key in reader.tensors("model.") if ".lora_" in key)
        read = {checkpoint / name for name in reader.files_read - {".metadata"}}
    assert read == set(files_holding_only(checkpoint, "adapter"))


def test_a_merged_export_is_sharded_and_holds_peft_merge_and_unload_values(tmp_path):
    model = with_trained_adapters(llama())
    checkpoint = save(tmp_path, model, lora=True)
    reference = peft.get_peft_model(llama(), peft_config(LoraConfig(**LORA)))
    reference.base_model.model.load_state_dict(model.state_dict())
    expected = reference.merge_and_unload().state_dict()

    out = tmp_path / "merged"
    out.mkdir()
    safetensors_torch.save_file(llama().state_dict(), out / "model.safetensors")  # an earlier, unsharded export
    export_hf(checkpoint, out, merge=True, max_shard_bytes=16 << 10)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and {out / file for file in index["weight_map"].values()} == set(shards)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
    moved = [name for name in expected if not torch.equal(expected[name], llama().state_dict()[name])]
    assert sorted({name.rsplit(".", 2)[-2] for name in moved}) == ["down_proj", "q_proj", "v_proj"]


@pytest.mark.parametrize("export", ["--out", "--hf"])
def test_a_damaged_optimizer_file_stops_no_export_and_a_damaged_model_file_does_naming_it(tmp_path, export):
    model = llama()
    checkpoint = save(tmp_path, model, lora=False)
    optimizer_only = files_holding_only(checkpoint, "other")
    model_files = files_holding_only(checkpoint, "model")
    assert optimizer_only and model_files, "the model's entries should have files of their own"

    def exported() -> dict[str, torch.Tensor]:
        if export == "--out":
            export_safetensors(checkpoint, tmp_path / "out.safetensors")
            return safetensors_torch.load_file(tmp_path / "out.safetensors")
        export_hf(checkpoint, tmp_path / "hf")
        return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()

    flip_a_byte(optimizer_only[0])
    weights = exported()
    for name, tensor in model_weights(model).items():
        assert torch.equal(weights[name], tensor), name
    damaged = flip_a_byte(model_files[-1])
    with pytest.raises(DamagedCheckpointError, match=f"checkpoint file {damaged} is corrupt"):
        exported()


def test_a_checkpoint_with_model_and_optimizer_in_the_same_files_still_exports_every_file_it_reads_checked(
    tmp_path,
):
    model = llama()
    checkpoint = save_in_the_old_layout(tmp_path, model)
    files = keys_by_file(checkpoint)
    mixed = [file for file, keys in files.items() if {file_group(key) for key in keys} >= {"model", "other"}]
    assert mixed, "the old layout puts model and optimizer entries in the same files"

    export_hf(checkpoint, tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for name, tensor in model_weights(model).items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    damaged = flip_a_byte(mixed[0])
    with pytest.raises(DamagedCheckpointError, match=f"checkpoint file {damaged} is corrupt"):
        export_safetensors(checkpoint, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists() and not list(tmp_path.glob("*.tmp"))


def test_a_resume_loads_the_split_checkpoint_exactly(tmp_path):
    model = with_trained_adapters(llama())
    checkpoint = save(tmp_path, model, lora=True)
    groups = {frozenset(file_group(key) for key in keys) for keys in keys_by_file(checkpoint).values()}
    assert groups == {frozenset({"model"}), frozenset({"adapter"}), frozenset({"other"})}
    into = with_trained_adapters(llama())
    optimizer = torch.optim.AdamW([p for p in into.parameters() if p.requires_grad], lr=1e-3)
    checker = Checkpointer(checkpoint.parent, keep_last=None, rank=0, world_size=1, config={})
    checker.load(checkpoint, {"model": ModelState(into), "optimizer": OptimizerState(into, optimizer)})
    for name, tensor in into.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    assert all(len(state) == 3 for state in optimizer.state.values())  # step and both moments


def test_save_final_hf_exports_past_a_damaged_optimizer_file_and_falls_back_past_a_damaged_model_file(tmp_path, caplog):
    model = llama()
    config = run_config(lora=False)
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep_last=None, rank=0, world_size=1, config=config)
    for step in (1, 2):
        checkpointer.save(step, training_state(model, step))
    newest = checkpointer.directory / "step-2"
    flip_a_byte(files_holding_only(newest, "other")[0])
    assert export_newest_hf(checkpointer.directory, tmp_path / "hf") == (newest, len(model.state_dict()))

    damaged = flip_a_byte(files_holding_only(newest, "model")[0])
    assert export_newest_hf(checkpointer.directory, tmp_path / "hf") == (
        checkpointer.directory / "step-1",
        len(model.state_dict()),
    )
    assert f"checkpoint file {damaged} is corrupt" in caplog.text and "falling back" in caplog.text


def test_a_stacked_expert_weight_merges_each_experts_own_adapter_as_peft_computes_it():
    """peft's adapter on a stacked (experts, out, in) weight: expert e's update is B_e @ A_e, A's rows and B's
    columns laid out as peft lays them; the merge adds exactly peft's delta weight."""
    peft = pytest.importorskip("peft")
    from paratrain.tools.export_lora import merge_adapter

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.down_proj = torch.nn.Parameter(torch.randn(3, 5, 4))  # (experts, out, in)

    torch.manual_seed(0)
    config = peft.LoraConfig(r=2, lora_alpha=6, target_parameters=["down_proj"], init_lora_weights=False)
    holder = peft.inject_adapter_in_model(config, torch.nn.Sequential(Experts()))
    wrapper = holder[0]
    weight, down, up = (
        t.detach() for t in (wrapper.get_param(), wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight)
    )
    expected = weight + wrapper.get_delta_weight("default").detach()
    merged = merge_adapter(weight.clone(), down=down, up=up, scaling=3.0)  # an fp32 weight is merged in place
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-6)
