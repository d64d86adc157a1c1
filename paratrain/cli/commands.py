"""The commands other than ``train``: config show, export, checkpoint check, the dry run, pipeline show, report,
bench comm, verify, slurm, plan and lighthouse. Each is ``NAME_command(args) -> exit code``.

Lazy imports: a command whose tool loads DTensor, DCP, matplotlib or torch's launcher imports it when it runs
(marked where it stands), so every other command, and the launcher of ``paratrain train``, never pays for it."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from paratrain.checkpoint.manifest import named_checkpoint
from paratrain.config.loading import config_to_yaml, load_config
from paratrain.errors import ConfigError
from paratrain.launch.launcher import LaunchOptions, launch
from paratrain.launch.lighthouse import run_lighthouse
from paratrain.launch.rank_logging import configure_logging
from paratrain.launch.slurm import SlurmJob, render_sbatch
from paratrain.launch.slurm_groups import render_group_sbatch
from paratrain.planner.command import plan_command_text
from paratrain.planner.memory_check import maybe_resolve_auto
from paratrain.tools.verify import verify


def lighthouse_command(args: argparse.Namespace) -> int:
    return run_lighthouse(
        bind=args.bind,
        min_replicas=args.min_replicas,
        join_timeout_ms=args.join_timeout_ms,
        heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        address_file=args.address_file,
    )


def checkpoint_check_command(args: argparse.Namespace) -> int:
    args.checkpoint = str(named_checkpoint(Path(args.checkpoint)))
    options = LaunchOptions(args.nproc_per_node, 1, 0, None, 0)
    options.validate()
    if args.nproc_per_node == 1:
        from paratrain.tools.checkpoint_check import check_checkpoint  # lazy: the trainer

        configure_logging(rank=0)
        print(check_checkpoint(Path(args.checkpoint), args.overrides))
        return 0
    worker = "paratrain.tools.checkpoint_check"
    return launch(options, [args.checkpoint, *args.overrides], env={}, worker_module=worker)


def dry_run_command(args: argparse.Namespace) -> int:
    from paratrain.planner.dry_run import dry_run  # lazy: DTensor and a fake process group

    nnodes = args.nnodes or 1
    config = load_config(args.config, args.overrides)
    config = maybe_resolve_auto(config, world_size=args.nproc_per_node * nnodes, nproc_per_node=args.nproc_per_node)
    print(dry_run(config, nproc_per_node=args.nproc_per_node, nnodes=nnodes))
    return 0


def config_show_command(args: argparse.Namespace) -> int:
    print(config_to_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def export_command(args: argparse.Namespace) -> int:
    from paratrain.tools.export import export_hf, export_safetensors  # lazy: DCP's reader

    checkpoint = named_checkpoint(Path(args.checkpoint))
    if args.merge and not args.hf:
        raise ConfigError("--merge writes a Hugging Face model directory: give it with --hf OUT_DIR")
    if args.hf:
        if Path(args.hf).is_file():
            raise ConfigError(f"--hf {args.hf} is a file: give the directory to write the Hugging Face model into")
        count = export_hf(checkpoint, Path(args.hf), merge=args.merge)
        print(
            f"wrote {checkpoint.name}: {count} tensors and their config to {args.hf} (transformers' from_pretrained "
            f"loads it; a LoRA run's adapter, without --merge, peft's PeftModel.from_pretrained onto the base)"
        )
    else:
        if Path(args.out).is_dir():
            raise ConfigError(
                f"--out {args.out} is a directory: give the file to write, e.g. --out "
                f"{Path(args.out) / 'model.safetensors'} (or --hf {args.out} for a Hugging Face model directory)"
            )
        count = export_safetensors(checkpoint, Path(args.out))
        print(f"wrote {checkpoint.name}: {count} tensors to {args.out}")
    return 0


def pipeline_show_command(args: argparse.Namespace) -> int:
    from paratrain.tools.pipeline_show import show_pipeline  # lazy: torch.distributed.pipelining, matplotlib

    config = load_config(args.config, args.overrides)
    out = Path(args.out) if args.out else config.run.output_dir / "pipeline" / "schedule.png"
    print(
        show_pipeline(
            config,
            world_size=args.nproc_per_node * args.nnodes,
            nproc_per_node=args.nproc_per_node,
            out=out,
            run_dir=Path(args.run) if args.run else None,
        )
    )
    return 0


def report_command(args: argparse.Namespace) -> int:
    from paratrain.tools.report import NO_MEMORY, write_report  # lazy: matplotlib

    runs = [Path(run) for run in args.runs]
    report = write_report(runs, out=Path(args.out) if args.out else runs[0] / "report")
    for plot in report.plots:
        print(f"wrote {plot}")
    if not report.memory_keys:
        print(NO_MEMORY)
    print(f"wrote {report.html}")
    return 0


def bench_comm_command(args: argparse.Namespace) -> int:
    from paratrain.tools.bench_comm import run_benchmark  # lazy: torch.distributed's launcher, matplotlib

    bench = run_benchmark(
        nproc_per_node=args.nproc_per_node,
        sizes=args.sizes,
        iters=args.iters,
        warmup=args.warmup,
        device=args.device,
        out=Path(args.out),
    )
    return 0 if bench else 1


def verify_command(args: argparse.Namespace) -> int:
    return verify(args.config, args.overrides, nproc_per_node=args.nproc_per_node, steps=args.steps)


def slurm_command(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)  # bad overrides are refused here, not on the cluster
    job = SlurmJob(
        config=Path(args.config).resolve(),
        overrides=tuple(args.overrides),
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        job_name=config.run.name,
        output_dir=config.run.output_dir.resolve(),
        time=args.time,
        partition=args.partition,
        device=args.device,
        replica_groups=args.replica_groups,
        max_restarts=args.max_restarts,
    )
    job.validate()
    render = render_group_sbatch if job.replica_groups != 1 else render_sbatch
    if args.submit and shutil.which("sbatch") is None:
        raise ConfigError("--submit needs Slurm's sbatch on PATH: run on a Slurm login node, or drop --submit")
    script = Path(args.out) if args.out else job.output_dir / "slurm.sbatch"
    if script.is_dir():
        raise ConfigError(
            f"--out {args.out} is a directory: give the script's file name, e.g. --out {script / 'job.sbatch'}"
        )
    script.parent.mkdir(parents=True, exist_ok=True)
    job.output_dir.mkdir(parents=True, exist_ok=True)  # Slurm writes slurm-<job>.out there and creates no folder
    script.write_text(render(job, workdir=Path.cwd()))
    print(f"wrote {script}")
    if args.submit:
        submitted = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
        if submitted.returncode != 0:
            print(f"paratrain: sbatch failed: {submitted.stderr.strip()}", file=sys.stderr)
            return submitted.returncode
        print(f"submitted job {submitted.stdout.strip().split(';')[0]}")
    return 0


def plan_command(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    text, code = plan_command_text(
        config,
        config_path=args.config,
        gpus=args.gpus,
        gpu_memory=args.gpu_memory,
        nodes=args.nodes,
        host_memory=args.host_memory,
        mtbf_hours=args.mtbf_hours,
        save_bandwidth=args.save_bandwidth,
    )
    print(text)
    return code
