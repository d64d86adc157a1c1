"""benchmarks/float8_checkpointing.py runs only on a GPU of capability 8.9; what CI can check of it: every run's
command is a valid config of the 1.5B Llama with the one change it claims, and the tables read metrics as the
runs write them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from paratrain.config.loading import load_config
from tests.tools.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def script():
    return load_benchmark("float8_checkpointing")


def config_of(script, run: str, tmp_path: Path, *, layout: str = "single", steps: int = 300, shape: str = "1.5b"):
    command = script.run_command(
        run,
        tmp_path / run,
        tmp_path / "corpus",
        tmp_path / "tokenizer",
        layout=layout,
        steps=steps,
        micro_batch=8,
        shape=shape,
    )
    config_path, overrides = command[command.index("train") + 1], command[command.index("train") + 2 :]
    return load_config(Path(script.titan.REPO_ROOT) / config_path, overrides)


@pytest.mark.parametrize("layout", ["single", "fsdp"])
@pytest.mark.parametrize("run", ["bf16", "float8-tensorwise", "float8-rowwise", "selective", "full"])
def test_every_run_is_the_matched_llama_with_only_its_own_change(script, tmp_path, run, layout):
    config = config_of(script, run, tmp_path, layout=layout)
    reference = config_of(script, "bf16", tmp_path, layout=layout)
    shape = config.model.args
    assert (shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]) == (2048, 16, 8192)
    assert config.precision == "bf16" and config.parallel.compile and config.train.max_steps == 300
    assert config.parallel.strategy == layout
    float8 = config.parallel.float8
    assert float8.enabled == run.startswith("float8") and not float8.emulate
    if float8.enabled:
        assert float8.scaling == run.removeprefix("float8-")
    expected_checkpointing = run if run in ("selective", "full") else "none"
    assert config.parallel.activation_checkpointing == expected_checkpointing
    # Nothing else differs from the bf16 reference (the output directory aside).
    changed = config.model_dump(exclude={"run", "data"})
    unchanged = reference.model_dump(exclude={"run", "data"})
    changed["parallel"].pop("float8"), unchanged["parallel"].pop("float8")
    changed["parallel"]["activation_checkpointing"] = unchanged["parallel"]["activation_checkpointing"]
    assert changed == unchanged


def test_the_wide_shape_is_llama_3_8bs_layers_and_changes_nothing_else(script, tmp_path):
    wide = config_of(script, "float8-tensorwise", tmp_path, shape="wide").model_dump(exclude={"run", "data"})
    narrow = config_of(script, "float8-tensorwise", tmp_path).model_dump(exclude={"run", "data"})
    resized = ("hidden_size", "intermediate_size", "num_hidden_layers")
    assert [wide["model"]["args"].pop(key) for key in resized] == [4096, 14336, 6]
    for key in resized:
        narrow["model"]["args"].pop(key)
    assert wide == narrow and wide["parallel"]["float8"]["enabled"]


def write_metrics(path: Path, losses: dict[int, float], *, tokens_per_s: float, peak_mb: float) -> Path:
    path.mkdir(parents=True)
    records = [
        {"step": step, "loss": loss, "tokens_per_s": tokens_per_s, "mem_peak_reserved_mb_max": peak_mb}
        for step, loss in losses.items()
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    return path / "metrics.jsonl"


def test_the_tables_compare_float8_and_checkpointing_with_the_bf16_run(script, tmp_path, capsys):
    bf16 = {step: 10.0 - step / 100 for step in range(1, 301)}
    float8 = {step: loss * (1.01 if step == 250 else 1.0) for step, loss in bf16.items()}
    runs = {
        "bf16": script.read_run(
            "bf16", write_metrics(tmp_path / "a", bf16, tokens_per_s=100, peak_mb=40960), skip_steps=10
        ),
        "float8-tensorwise": script.read_run(
            "float8-tensorwise", write_metrics(tmp_path / "b", float8, tokens_per_s=130, peak_mb=38912), skip_steps=10
        ),
        "selective": script.read_run(
            "selective", write_metrics(tmp_path / "c", bf16, tokens_per_s=95, peak_mb=20480), skip_steps=10
        ),
    }
    float8_line = script.float8_lines(runs)[1]
    assert "130 tokens/s" in float8_line and "tokens/s / bf16 1.300" in float8_line
    assert "largest loss gap to bf16 (last half) 1.00%" in float8_line and "300:7.000" in float8_line
    assert script.checkpointing_lines(runs) == [
        "checkpointing none: peak reserved 40.0 GiB, 100 tokens/s",
        "checkpointing selective: peak reserved 20.0 GiB, 95 tokens/s (memory / none 0.50, tokens/s / none 0.950)",
    ]


def test_the_loss_runs_corpus_is_the_standard_librarys_source_up_to_the_budget(script, tmp_path):
    """The loss comparison reads MBs of source, not the 100k tokens of docstrings a 300-step run memorises."""
    corpus, tokenizer = script.titan.make_data(tmp_path / "data", source_mb=1)
    documents = [json.loads(line)["text"] for line in (corpus / "corpus.jsonl").read_text().splitlines()]
    size = sum(len(text.encode()) for text in documents)
    assert len(documents) == 8 and 0.7e6 <= size <= 3e6  # the budget, less the files 8 shares leave over
    assert "def " in documents[0] and (tokenizer / "tokenizer.json").is_file()
