"""Load a tiny random GPT-2 into Megatron-Core with tensor parallelism and print how close it is to HF.

    accelerate launch --cpu --num_processes 2 examples/gpt2_parity_demo.py --tp 2
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from megatron_plugin import MegatronLMPlugin
from megatron_plugin.engine.distributed import initialize
from megatron_plugin.models.modeling import MegatronModel


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    hf = GPT2LMHeadModel(config).eval()
    plugin = MegatronLMPlugin(tp_degree=args.tp)
    layout = initialize(plugin, config)
    model = MegatronModel.from_hf(hf, plugin).eval()

    ids = torch.randint(0, config.vocab_size, (2, 32))
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    back = model.hf_state_dict()
    exact = all(torch.equal(back[k], v) for k, v in hf.state_dict().items() if k != "lm_head.weight")
    local = sum(p.numel() for p in model.parameters())
    print(f"[rank {layout.rank}] tp {layout.tp_rank}/{layout.tp_size}: {local} parameters here; "
          f"max |logits - HF| = {diff:.2e}; HF -> Megatron -> HF bit-exact: {exact}")


if __name__ == "__main__":
    main()
