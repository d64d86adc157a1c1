"""Run by LayoutRuns under tests.launch_workers: trains several runs one after the other in the same
processes, so a test module pays the processes' start-up (most of a tiny run's time) once per world
size instead of once per layout. Each Trainer joins this script's process group and leaves it open.

Argument: a JSON file holding a list of [config_path, [overrides...]].
"""

import json
import sys

import torch.distributed as dist

from paratrain.config.loading import load_config
from paratrain.train import configure_logging, freeze_imported_objects, run


def main(runs_file: str) -> None:
    freeze_imported_objects()
    dist.init_process_group("gloo")
    configure_logging(dist.get_rank())
    for config_path, overrides in json.loads(open(runs_file).read()):
        run(load_config(config_path, overrides))
        # What the run imported (dynamo, transformers' model modules) is walked by no later run's collections.
        freeze_imported_objects()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
