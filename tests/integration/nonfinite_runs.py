"""Run by test_nonfinite under tests.launch_workers: trains several runs one after the other in the same
processes (as tests/train_many.py does), each with its own PARATRAIN_FAULT, through the per-rank entry
point ``paratrain.train.main``, and has rank 0 write each run's exit code to a JSON file.

Arguments: a JSON file holding a list of [name, config_path, [overrides...], fault or null], and the
path to write {name: exit code} to.
"""

import json
import os
import sys

import torch.distributed as dist

from paratrain.launch.faults import ENV_VAR
from paratrain.train import main as train_main


def main(runs_file: str, codes_file: str) -> None:
    dist.init_process_group("gloo")
    codes = {}
    for name, config_path, overrides, fault in json.loads(open(runs_file).read()):
        os.environ.pop(ENV_VAR, None)
        if fault:
            os.environ[ENV_VAR] = fault
        codes[name] = train_main([config_path, *overrides])
    if dist.get_rank() == 0:
        with open(codes_file, "w") as handle:
            json.dump(codes, handle)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
