"""Launched by tests/test_faults.py: a tiny GPT-2 trains under `accelerate launch`; at step 3 the rank
named by the first argument (default 1) kills itself with SIGKILL: with `forward` as the second argument, in
the middle of the step's forward (from a module hook, after a few modules ran; its peers are already inside
the step's collectives), else just before the step (its peers wait in the step's first collective). Prints
`KILLED <rank> AT <time>` just before, so the test can time how long the surviving ranks take to end."""
import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader

from megatron_plugin import Accelerator, MegatronLMDummyScheduler
from tests.training import optimizer_for, token_dataset
from tests.models import tiny_gpt2

victim = int(sys.argv[1]) if len(sys.argv) > 1 else 1
in_forward = len(sys.argv) > 2 and sys.argv[2] == "forward"


def die():
    print(f"KILLED {victim} AT {time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


torch.set_num_threads(1)
model = tiny_gpt2()
opt = optimizer_for(model)
accelerator = Accelerator()
model, opt, sched, loader = accelerator.prepare(
    model, opt, MegatronLMDummyScheduler(opt, total_num_steps=100), DataLoader(token_dataset(400, 1000), batch_size=2)
)
model.train()
for step, batch in enumerate(loader, 1):
    if step == 3 and accelerator.process_index == victim:
        if not in_forward:
            die()
        calls = []

        def hook(*_):  # returns None: leaves every module's output as it is
            calls.append(1)
            if len(calls) == 5:
                die()

        torch.nn.modules.module.register_module_forward_hook(hook)
    out = model(**batch)
    accelerator.backward(out.loss)
    opt.step()
    sched.step()
    opt.zero_grad()
    print(f"rank {accelerator.process_index} step {step} loss {out.loss.item():.4f}", flush=True)
print(f"rank {accelerator.process_index} finished", flush=True)
