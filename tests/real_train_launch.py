"""``jagg train`` as the tests launch it with accelerate / torchrun: the CLI unchanged, plus what each rank holds at
the end, saved to ``<log.output_dir>/rank<r>.pt`` so that the test can compare replicas and measure shards:
``weights`` (the trainable weights, whole: gathered from the shards under FSDP), ``param_local`` / ``param_full``
(the trainable parameters' elements this rank stores, and in all), ``adam_local`` / ``adam_full`` (the same for
AdamW's two moments; ``reference_local`` / ``reference_full`` for the frozen KL reference copy), ``dtypes`` (of the
trainable parameters as stored), ``engine`` (its name), ``fillers`` (FSDP: the filler calls this rank made to stay
in step) and ``minibatches`` (per epoch, the global prompt group of each sample of each of this rank's minibatches).

    accelerate launch --multi_gpu --num_processes 2 tests/real_train_launch.py train --config <yaml> ...
"""

import sys

import torch
from torch.distributed.tensor import DTensor

from jagg.cli import main
from jagg.infra.distributed import exit_process
from jagg.trainers.diffusers_trainer import DiffusersTrainer

_train = DiffusersTrainer.train
_minibatches = DiffusersTrainer.minibatches


def _recorded_minibatches(self, prompt_groups):
    out = _minibatches(self, prompt_groups)
    self.__dict__.setdefault("cuts", []).append([prompt_groups[mb].tolist() for mb in out])
    return out


def _local(t: torch.Tensor) -> int:
    return t.to_local().numel() if isinstance(t, DTensor) else t.numel()


def _train_and_save(self):
    records = _train(self)
    weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
               for n, p in self.named_params.items()}                       # a collective under FSDP: every rank
    moments = [s[k] for s in self.opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    lockstep = getattr(self.engine, "lockstep", None)
    reference = list(self.policy.reference_model.parameters()) if self.policy.reference_model is not None else []
    torch.save({"weights": weights, "engine": self.engine.name, "dtypes": sorted({str(p.dtype) for p in self.params}),
                "reference_local": sum(_local(p) for p in reference),
                "reference_full": sum(p.numel() for p in reference),
                "param_local": sum(_local(p) for p in self.params), "param_full": sum(p.numel() for p in self.params),
                "adam_local": sum(_local(m) for m in moments), "adam_full": sum(m.numel() for m in moments),
                "fillers": lockstep.fillers if lockstep is not None else 0, "minibatches": getattr(self, "cuts", [])},
               self.out / f"rank{self.rank}.pt")
    return records


if __name__ == "__main__":
    DiffusersTrainer.train = _train_and_save
    DiffusersTrainer.minibatches = _recorded_minibatches
    exit_process(main(sys.argv[1:]))
