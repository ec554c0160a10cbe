"""The word embedding's backward into main_grad under TP, one GPU, no collectives:

    python benchmarks/embedding_backward_probe.py [--vocab 50257 --hidden 1280 --tokens 16384 --tp 2]

Each TP rank holds vocab / tp rows; an id of another rank's rows looks up some local row whose output and
gradient are then zero. The backward (layers/embedding.py) adds every token's gradient row into the fp32
main_grad with a sorted `index_put_(accumulate=True)`, which adds the rows of one index one after another. Two
ways of placing the other ranks' ids: all on row 0 (megatron-core's choice, and ours until 2026-11-29), and at
each id's place in its own rank's part (`layers/embedding.local_rows`). Prints the time of each and whether the
two main_grads agree bit for bit (the zeros land on other rows; no sum changes)."""

import argparse

import torch
from bench_steps import cuda_seconds_per_call

from megatron_plugin.layers.embedding import local_rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--hidden", type=int, default=1280)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--tp", type=int, default=2)
    args = p.parse_args()
    for name in ("vocab", "hidden", "tokens", "tp"):
        if getattr(args, name) < 1:
            p.error(f"--{name} {getattr(args, name)}: must be at least 1")
    if not torch.cuda.is_available():
        p.error("no CUDA GPU here: this probe times the GPU's index_put_; run it on a GPU machine")
    rows = -(-args.vocab // (args.tp * 128)) * 128  # megatron pads the vocabulary to a multiple of 128 x TP
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=g)
    grad = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=g)
    spread, outside = local_rows(ids, 0, rows)  # rank 0
    grad = grad.masked_fill(outside.unsqueeze(-1), 0.0)  # the zeroed output's gradient
    row0 = spread.masked_fill(outside, 0)
    results = {}
    for name, index in (("row 0", row0), ("spread", spread)):
        main_grad = torch.zeros(rows, args.hidden, device="cuda")

        def step():
            main_grad.index_put_((index,), grad.float(), accumulate=True)

        ms = cuda_seconds_per_call(step) * 1e3
        main_grad.zero_()
        step()
        results[name] = (ms, main_grad.clone())
    print(f"vocab {args.vocab}, TP = {args.tp} ({rows} rows a rank), {args.tokens} tokens, hidden {args.hidden}; "
          f"{int(outside.sum())} ids of other ranks")
    for name, (ms, _) in results.items():
        print(f"  other ranks' ids on {name:7s} {ms:7.3f} ms")
    same = torch.equal(results["row 0"][1], results["spread"][1])
    print(f"  main_grad bit for bit the same: {same}")


if __name__ == "__main__":
    main()
