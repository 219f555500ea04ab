"""``jagg train`` as tests/test_real_train.py launches it with accelerate / torchrun: the CLI unchanged, plus each
rank's trained weights saved to ``<log.output_dir>/rank<r>.pt`` at the end, so that the test can compare replicas.

    accelerate launch --multi_gpu --num_processes 2 tests/real_train_launch.py train --config <yaml> ...
"""

import sys

import torch

from jagg.cli import main
from jagg.trainers.diffusers import DiffusersTrainer

_train = DiffusersTrainer.train


def _train_and_save(self):
    records = _train(self)
    torch.save({n: p.detach().cpu() for n, p in self.named_params.items()}, self.out / f"rank{self.rank}.pt")
    return records


if __name__ == "__main__":
    DiffusersTrainer.train = _train_and_save
    sys.exit(main(sys.argv[1:]))
