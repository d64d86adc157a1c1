from __future__ import annotations

import gc
import io
import json
import time
from dataclasses import dataclass

import pytest
import torch
import xxhash
from torch.distributed.checkpoint.stateful import Stateful

from paratrain.checkpoint import Checkpointer, find_checkpoints, verify_checkpoint
from paratrain.checkpoint import writer as writer_module
from paratrain.checkpoint.hashing import HashingWriter
from paratrain.checkpoint.manifest import is_complete
from paratrain.checkpoint.safe_reader import SafeFileSystemReader
from paratrain.checkpoint.state import (
    ModelState,
    OptimizerState,
    Progress,
    RNGState,
    cuda_generator_names,
)
from paratrain.errors import CheckpointError
from paratrain.launch.heal_payload import SameLayoutOptimizerState


def make_checkpointer(tmp_path, keep_last=2) -> Checkpointer:
    return Checkpointer(tmp_path / "checkpoints", keep_last=keep_last, rank=0, world_size=1, config={"seed": 0})


def state(step: int) -> dict:
    torch.manual_seed(step)
    return {"model": ModelState(torch.nn.Linear(4, 2)), "progress": Progress(step)}


def steps_on_disk(checkpointer: Checkpointer) -> list[int]:
    return [step for step, _ in find_checkpoints(checkpointer.directory)]


def test_rotation_keeps_the_newest_complete_checkpoints(tmp_path):
    checkpointer = make_checkpointer(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        checkpointer.save(step, state(step))
    assert steps_on_disk(checkpointer) == [30, 40]


def test_rotation_removes_stale_incomplete_saves_but_counts_only_complete_ones(tmp_path):
    checkpointer = make_checkpointer(tmp_path, keep_last=1)
    checkpointer.save(10, state(10))
    (checkpointer.directory / "step-15").mkdir()  # a crashed save: no manifest
    (checkpointer.directory / "step-25").mkdir()  # newer than what completes next: left alone
    checkpointer.save(20, state(20))
    assert steps_on_disk(checkpointer) == [20, 25]
    assert checkpointer.latest_verified() == checkpointer.directory / "step-20"


def test_rotation_hides_a_doomed_checkpoint_at_once_and_frees_its_files_before_the_next_save(tmp_path):
    checkpointer = make_checkpointer(tmp_path, keep_last=1)
    checkpointer.save(10, state(10))
    (checkpointer.directory / ".deleting-step-5").mkdir()  # left by a run killed while deleting
    (checkpointer.directory / ".deleting-step-5" / "shard.distcp").write_bytes(b"x")
    checkpointer.save(20, state(20))
    assert steps_on_disk(checkpointer) == [20]  # step-10 is out of sight as soon as step-20 is complete
    assert checkpointer.latest_verified() == checkpointer.directory / "step-20"
    checkpointer.save(30, state(30))  # waits for step-10's deletion before writing
    assert not (checkpointer.directory / ".deleting-step-10").exists()
    assert not (checkpointer.directory / ".deleting-step-5").exists()
    checkpointer.close()  # waits for step-20's
    assert sorted(path.name for path in checkpointer.directory.iterdir()) == ["step-30"]


def test_load_restores_saved_values(tmp_path):
    checkpointer = make_checkpointer(tmp_path)
    saved = state(7)
    checkpointer.save(7, saved)
    restored = state(99)
    checkpointer.load(checkpointer.directory / "step-7", restored)
    assert restored["progress"].step == 7
    assert torch.equal(restored["model"].model.weight, saved["model"].model.weight)


@dataclass
class Generators(Stateful):
    """Stands for RNGState on a machine without GPUs: one entry per generator, as many as it is given."""

    values: dict[str, torch.Tensor]

    def state_dict(self) -> dict:
        return {"rank0": dict(self.values)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.values = dict(state_dict["rank0"])


def test_optional_state_saved_with_fewer_generators_restores_those_it_has_and_names_the_rest(tmp_path, caplog):
    checkpointer = make_checkpointer(tmp_path)
    checkpointer.save(5, {"rng": Generators({"cuda": torch.tensor([1.0])})})
    resumed = Generators({"cuda": torch.tensor([0.0]), "cuda_1": torch.tensor([9.0])})
    checkpointer.load(checkpointer.directory / "step-5", {"rng": resumed}, optional=("rng",))
    assert resumed.values == {"cuda": torch.tensor([1.0]), "cuda_1": torch.tensor([9.0])}
    assert "holds no ['rng.rank0.cuda_1']" in caplog.text


def test_a_rank_driving_several_gpus_checkpoints_each_ones_generator_its_own_first():
    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert cuda_generator_names([*gpus, torch.device("cpu")]) == {"cuda": gpus[0], "cuda_1": gpus[1]}
    assert cuda_generator_names([torch.device("cpu")]) == {}
    assert set(RNGState(0, [torch.device("cpu")]).state_dict()["rank0"]) == {"torch", "python"}


def test_a_fused_optimizer_resumed_from_a_foreach_checkpoint_keeps_its_step_counts_beside_the_parameters(tmp_path):
    checkpointer = make_checkpointer(tmp_path)
    model = torch.nn.Linear(2, 2)
    foreach = torch.optim.AdamW(model.parameters(), foreach=True)
    model(torch.ones(1, 2)).sum().backward()
    foreach.step()
    checkpointer.save(1, {"optimizer": OptimizerState(model, foreach)})
    model.zero_grad(set_to_none=True)  # as when a run resumes: torch builds the state to load into from none
    fused = torch.optim.AdamW(model.parameters(), fused=True)
    checkpointer.load(checkpointer.directory / "step-1", {"optimizer": OptimizerState(model, fused)})
    assert fused.param_groups[0]["fused"] is True
    for param in model.parameters():
        step = fused.state[param]["step"]
        assert step.device == param.device and step.dtype == torch.float32 and step.item() == 1
    fused.step()  # the fused kernel accepts the restored state


def test_an_optimizer_state_loads_whole_into_an_optimizer_whose_parameters_hold_gradients():
    """A replica group heals after a step it could not commit: its fresh optimizer's parameters still hold
    that step's gradients. Every moment of the state it receives must load (torch loaded none there)."""
    torch.manual_seed(0)
    source = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(source.parameters())
    source(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    sent = OptimizerState(source, optimizer).state_dict()
    receiver = torch.nn.Linear(4, 3)
    fresh = torch.optim.AdamW(receiver.parameters())
    receiver(torch.randn(2, 4)).sum().backward()  # the uncommitted step's gradients
    OptimizerState(receiver, fresh).load_state_dict(sent)
    for mine, theirs in zip(receiver.parameters(), source.parameters()):
        assert mine.grad is None
        for name in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fresh.state[mine][name], optimizer.state[theirs][name], rtol=0, atol=0)


def test_a_peer_on_the_same_layout_receives_the_optimizer_state_as_bytes_loaded_weights_only_and_steps_alike():
    """A replica group heals from a live one built by the same config: the optimizer's own state dict goes through
    bytes read with weights_only=True, into a fresh optimizer whose parameters still hold an uncommitted step's
    gradients, and both then take the same step to the same weights."""
    torch.manual_seed(0)
    source = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(source.parameters(), lr=0.1)
    source(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    sent = io.BytesIO()
    torch.save(SameLayoutOptimizerState(optimizer).state_dict(), sent)
    receiver = torch.nn.Linear(4, 3)
    receiver.load_state_dict(source.state_dict())
    fresh = torch.optim.AdamW(receiver.parameters(), lr=0.5)
    receiver(torch.randn(2, 4)).sum().backward()  # the uncommitted step's gradients
    received = torch.load(io.BytesIO(sent.getvalue()), weights_only=True)
    SameLayoutOptimizerState(fresh).load_state_dict(received)
    for entry in received["state"].values():  # the received tensors are not kept: steps do not write into them
        entry["exp_avg"].zero_()
    assert fresh.param_groups[0]["lr"] == 0.1  # the peer's settings, as a checkpoint's
    batch = torch.randn(2, 4)
    for model, its_optimizer in ((source, optimizer), (receiver, fresh)):
        its_optimizer.zero_grad(set_to_none=True)
        model(batch).sum().backward()
        its_optimizer.step()
    for mine, theirs in zip(receiver.parameters(), source.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        for name in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(fresh.state[mine][name], optimizer.state[theirs][name], rtol=0, atol=0)


def test_auto_resume_skips_a_damaged_latest_checkpoint(tmp_path, caplog):
    checkpointer = make_checkpointer(tmp_path, keep_last=3)
    checkpointer.save(1, state(1))
    checkpointer.save(2, state(2))
    (checkpointer.directory / "step-2" / ".metadata").write_bytes(b"garbage")
    assert checkpointer.choose_resume("auto") == checkpointer.directory / "step-1"
    assert "step-2/.metadata" in caplog.text


def test_auto_resume_skips_a_latest_checkpoint_with_a_truncated_shard_naming_it(tmp_path, caplog):
    checkpointer = make_checkpointer(tmp_path, keep_last=3)
    checkpointer.save(1, state(1))
    checkpointer.save(2, state(2))
    shard = next((checkpointer.directory / "step-2").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    assert checkpointer.choose_resume("auto") == checkpointer.directory / "step-1"
    assert f"checkpoint file {shard} is truncated" in caplog.text and "falling back" in caplog.text


def test_auto_resume_refuses_when_no_checkpoint_verifies(tmp_path):
    checkpointer = make_checkpointer(tmp_path)
    checkpointer.save(1, state(1))
    shard = next((checkpointer.directory / "step-1").glob("*.distcp"))
    shard.write_bytes(b"")
    with pytest.raises(CheckpointError, match="no checkpoint .* verifies"):
        checkpointer.choose_resume("auto")


def test_verify_names_a_missing_file(tmp_path):
    checkpointer = make_checkpointer(tmp_path)
    path = checkpointer.save(1, state(1))
    shard = next(path.glob("*.distcp"))
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard} is missing"):
        verify_checkpoint(path)


def test_fresh_directory_has_nothing_to_resume(tmp_path):
    assert make_checkpointer(tmp_path).choose_resume("auto") is None


class SlowWriter(HashingWriter):
    """Writes as DCP does, half a second late: a background save surely still in flight."""

    def write_data(self, *args, **kwargs):
        time.sleep(0.5)
        return super().write_data(*args, **kwargs)


@dataclass
class CompletionProbe(Stateful):
    """Records, when a save reads it, whether the checkpoint of step ``previous`` was complete."""

    directory: object
    previous: int
    seen_complete: list

    def state_dict(self):
        self.seen_complete.append(is_complete(self.directory / f"step-{self.previous}"))
        return {"previous": self.previous}

    def load_state_dict(self, state_dict): ...


def test_an_async_save_starts_only_once_the_previous_one_is_complete_and_holds_the_state_of_its_step(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(writer_module, "HashingWriter", SlowWriter)
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep_last=1, rank=0, world_size=1, config={}, async_save=True)
    model, seen_complete = torch.nn.Linear(4, 2), []
    expected = {}
    for step in (10, 20, 30):
        probe = CompletionProbe(checkpointer.directory, step - 10, seen_complete)
        started = time.perf_counter()
        checkpointer.save(
            step, {"model": ModelState(model), "progress": Progress(step), "probe": probe}, blocking=False
        )
        if step == 10:
            assert time.perf_counter() - started < 0.4, "the first save returned before its (slow) write"
            assert not is_complete(checkpointer.directory / "step-10")
        expected[step] = model.weight.detach().clone()
        with torch.no_grad():
            model.weight.add_(1.0)  # training goes on while the save is written
    assert checkpointer.wait() == checkpointer.directory / "step-30"
    checkpointer.close()

    assert seen_complete == [False, True, True]  # no step-0; step-10 and step-20 complete before the next began
    assert steps_on_disk(checkpointer) == [30]  # rotated as each save completed, never the one being written
    restored = {"model": ModelState(torch.nn.Linear(4, 2)), "progress": Progress()}
    checkpointer.load(checkpointer.directory / "step-30", restored)
    assert torch.equal(restored["model"].model.weight, expected[30]), "the checkpoint holds the weights of its step"


def test_a_run_directory_names_its_newest_complete_checkpoint(tmp_path):
    from paratrain.checkpoint.manifest import named_checkpoint, write_manifest

    checkpoints = tmp_path / "run" / "checkpoints"
    for step in (2, 10, 12):
        (checkpoints / f"step-{step}").mkdir(parents=True)
    for step in (2, 10):  # step-12's save did not finish
        write_manifest(checkpoints / f"step-{step}", step=step, config={}, world_size=1)
    assert named_checkpoint(tmp_path / "run") == checkpoints / "step-10"
    assert named_checkpoint(checkpoints) == checkpoints / "step-10"
    assert named_checkpoint(checkpoints / "step-12") == checkpoints / "step-12"  # named: refused by its check
    assert named_checkpoint(tmp_path / "elsewhere") == tmp_path / "elsewhere"


def test_the_manifest_lists_the_hashes_of_the_files_on_disk_taken_while_writing(tmp_path):
    checkpointer = Checkpointer(tmp_path / "checkpoints", keep_last=1, rank=0, world_size=1, config={})
    model = torch.nn.Linear(64, 64)
    path = checkpointer.save(1, {"model": ModelState(model), "progress": Progress(1)})

    listed = json.loads((path / "paratrain-manifest.json").read_text())["files"]
    data_files = sorted(name for name in listed if name.endswith(".distcp"))
    # the model's two tensors over the two writer threads' files, the step in a file of its own (none empty)
    assert len(data_files) == 3
    for name, entry in listed.items():
        on_disk = (path / name).read_bytes()
        assert entry == {"bytes": len(on_disk), "xxh3_128": xxhash.xxh3_128(on_disk).hexdigest()}


def test_the_models_entries_are_written_in_files_of_their_own_apart_from_the_optimizers(tmp_path):
    """So that an export reads and checks the model's files only."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    state = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer), "progress": Progress(1)}
    path = make_checkpointer(tmp_path).save(1, state)

    held: dict[str, set[str]] = {}
    for index, stored in SafeFileSystemReader(path).read_metadata().storage_data.items():
        held.setdefault(stored.relative_path, set()).add(index.fqn.split(".")[0])
    # two files each (one per writer thread): the model's, and the optimizer's with the step
    assert sorted("model" in roots for roots in held.values()) == [False, False, True, True]
    assert all(roots == {"model"} for roots in held.values() if "model" in roots)


@dataclass
class CollectionProbe(Stateful):
    """Notes whether automatic garbage collection is on each time DCP asks for, or hands back, its state."""

    seen: list[bool]

    def state_dict(self) -> dict:
        self.seen.append(gc.isenabled())
        return {"value": torch.ones(2)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.seen.append(gc.isenabled())


def test_no_garbage_collection_runs_while_a_checkpoint_is_saved_or_loaded_and_collection_is_back_after(tmp_path):
    """DCP's planning makes thousands of short-lived objects; each collection they set off walks the whole heap
    (a sixth of an fsdp x2 load in the checkpoint benchmark) and frees nothing of them."""
    checkpointer, seen = make_checkpointer(tmp_path), []
    path = checkpointer.save(10, {"probe": CollectionProbe(seen), "progress": Progress(10)})
    assert seen == [False] and gc.isenabled()
    checkpointer.load(path, {"probe": CollectionProbe(seen), "progress": Progress(0)})
    assert seen == [False, False, False] and gc.isenabled()
