"""Run under torchrun by tests/test_study_distributed.py: a data-parallel run's loss curve."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from study_settings import TINY

from selfattn.study.training import RunSpec, train_run


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    run = train_run(RunSpec("reverse", "rotary", 0), TINY, data_parallel=True)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(
                {"world": dist.get_world_size(), "losses": run["loss_curve"], "acc": run["accuracy_by_length"]}, f
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
