"""Sequence parallelism on CPU (gloo): TP=2 + SP trains, evaluates and scores tokens as one process does.

Under SP each TP rank holds half of the sequence between the tensor-parallel regions (norms, dropout, the
MoE router), so these runs take the same path as megatron-core's on GPU: the embedding's reduce-scatter,
the linears' gathers and reduce-scatters (`layers/sp_comm.py`), TransformerBlock's RNG fork (a no-op on
CPU: `patches.cpu_sequence_parallel`), and the sum over TP of the gradients of the parameters each rank
computed from its half (norms, router). The reference is the same script on one process (TP=1, the same
global batch), through `accelerator.prepare` too."""

import pytest
import torch
from torch.utils.data import DataLoader

from tests.spawn import run_on_ranks

STEPS = 5
ROWS = 4  # the global batch


def _model(name):
    from tests.models import tiny_gpt2, tiny_llama, tiny_moe

    if name == "gpt2":
        return tiny_gpt2("tied")
    if name == "gpt2_base":
        return tiny_gpt2("tied", lm_head=False)
    if name == "llama":
        return tiny_llama("llama")
    return tiny_moe("qwen2_moe", output_router_logits=True, router_aux_loss_coef=0.1)


def _run(name, tp, steps, seq_len=None):
    """Inside each process: `steps` training steps through prepare (SGD: an update moves with any
    gradient slip), then eval logits and log-probs of a fixed padded batch. Returns (losses, logits,
    log_probs, per-step load-balancing losses, the trained weights as HF tensors)."""
    from megatron_plugin import Accelerator, MegatronLMDummyScheduler, MegatronLMPlugin
    from tests.training import sft_dataset

    model = _model(name)
    data = sft_dataset(steps * ROWS, model.config.vocab_size)
    if seq_len is not None:
        data = [{k: v[:seq_len] for k, v in row.items()} for row in data]
    loader = DataLoader(data, batch_size=ROWS, shuffle=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    sched = MegatronLMDummyScheduler(opt, total_num_steps=steps, warmup_num_steps=1)
    # "_etp1": the experts whole on each TP rank (expert_tensor_parallel_size=1): their expert-data-parallel group
    # is then the TP pair, over which their gradients (each rank routed its sequence shard) must be summed
    etp = 1 if name.endswith("_etp1") else None
    plugin = MegatronLMPlugin(tp_degree=tp, sequence_parallelism=tp > 1, gradient_clipping=1.0, return_logits=True,
                              expert_tensor_parallel_size=etp)
    accelerator = Accelerator(megatron_lm_plugin=plugin)
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    assert model.model.module.config.sequence_parallel == (tp > 1)
    model.train()
    losses, balance = [], []
    for batch in loader:
        losses.append(model(**batch).loss.item())
        balance.append(float(model.metrics.get("load_balancing_loss", float("nan"))))
        if len(losses) == steps:
            break
    model.eval()
    batch = {k: torch.stack([row[k] for row in data[:ROWS]]) for k in data[0]}
    with torch.no_grad():
        logits = model(**batch).logits
    log_probs = model.compute_log_probs(batch)
    weights = model.hf_state_dict()
    accelerator.end_training()
    return losses, logits, log_probs, balance, weights


def _base_hidden(tp):
    """A base model (GPT2Model: no LM head) returns the whole sequence's hidden states on every TP rank
    (`MegatronGPT._postprocess` gathers them under SP), and their gradient reaches the weights as at TP=1."""
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.models.modeling import MegatronModel
    from tests.models import tiny_gpt2

    hf = tiny_gpt2("tied", lm_head=False)
    plugin = MegatronLMPlugin(tp_degree=tp, sequence_parallelism=tp > 1)
    initialize(plugin, hf.config)
    model = MegatronModel.from_hf(hf, plugin)
    model.module.train()
    ids = torch.randint(0, hf.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    hidden = model(ids, attention_mask=torch.ones_like(ids))
    weights = torch.linspace(-1, 1, hidden.numel()).reshape(hidden.shape)
    (hidden * weights).sum().backward()
    # matrices only: the vectors replicated over TP (norms, row-parallel biases) hold each rank's part until
    # the engine sums them, which this test leaves out
    grads = {k: v for k, v in model.hf_state_dict(grads=True).items() if v.dim() == 2}
    return hidden.detach(), grads


def _comm_grads():
    """sp_comm's gather on CPU: backward reduce-scatter by default, this rank's rows of the gradient with
    tensor_parallel_output_grad=False (the same loss computed on every rank)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.layers.sp_comm import gather_first_dim, reduce_scatter_first_dim
    from tests.models import tiny_gpt2

    initialize(MegatronLMPlugin(tp_degree=2, sequence_parallelism=True), tiny_gpt2().config)
    group, rank = parallel_state.get_tensor_model_parallel_group(), dist.get_rank()
    out = {}
    for reduce in (True, False):
        x = torch.full((2, 3), float(rank + 1), requires_grad=True)
        y = gather_first_dim(x, group, tensor_parallel_output_grad=reduce)
        w = torch.arange(12, dtype=torch.float32).reshape(4, 3) * (rank + 1)  # differs between ranks
        (y * w).sum().backward()
        out[reduce] = (y.detach(), x.grad.clone())
    x = torch.arange(8, dtype=torch.float32).reshape(4, 2).mul(rank + 1).requires_grad_()
    z = reduce_scatter_first_dim(x, group)
    (z * (rank + 1)).sum().backward()
    out["rs"] = (z.detach(), x.grad.clone())
    # the last-dimension gathers (vocab-parallel logits; a GQA layer's qkv when TP exceeds its KV heads)
    from megatron_plugin.layers.comm import all_gather_last_dim, gather_tensor_parallel_last_dim

    for name, gather in (("last", gather_tensor_parallel_last_dim), ("last_summed", all_gather_last_dim)):
        x = torch.full((2, 2), float(rank + 1), requires_grad=True)
        y = gather(x)
        (y * torch.arange(4.0) * (rank + 1)).sum().backward()  # each rank weighs the whole gathered tensor its own way
        out[name] = (y.detach(), x.grad.clone())
    return out


def test_sp_collectives_on_cpu_have_megatrons_gradients():
    r0, r1 = run_on_ranks(_comm_grads, 2)
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    for rank, got in enumerate((r0, r1)):
        gathered = torch.cat([torch.full((2, 3), 1.0), torch.full((2, 3), 2.0)])
        assert torch.equal(got[True][0], gathered) and torch.equal(got[False][0], gathered)
        rows = slice(2 * rank, 2 * rank + 2)
        assert torch.equal(got[True][1], (w * 1 + w * 2)[rows])  # summed over ranks, this rank's rows
        assert torch.equal(got[False][1], (w * (rank + 1))[rows])  # this rank's own gradient, its rows
        base = torch.arange(8, dtype=torch.float32).reshape(4, 2)
        assert torch.equal(got["rs"][0], (base * 3)[2 * rank:2 * rank + 2])
        # all-gathered: rank 0's rows carry its gradient 1, rank 1's its 2
        assert torch.equal(got["rs"][1], torch.tensor([[1.0, 1.0], [1.0, 1.0], [2.0, 2.0], [2.0, 2.0]]))
        cols = slice(2 * rank, 2 * rank + 2)
        for name in ("last", "last_summed"):
            assert torch.equal(got[name][0], torch.tensor([[1.0, 1.0, 2.0, 2.0]] * 2))
        # this rank's columns of its own gradient; of the gradients summed over ranks (x 1 + x 2)
        assert torch.equal(got["last"][1], (torch.arange(4.0) * (rank + 1))[cols].expand(2, 2))
        assert torch.equal(got["last_summed"][1], (torch.arange(4.0) * 3)[cols].expand(2, 2))


@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen2_moe", "qwen2_moe_etp1"])
def test_tp2_with_sequence_parallelism_trains_as_one_process(name):
    """5 SGD steps at TP=2 + SP (2 processes) give the losses of one process within 1e-5 relative, and then
    the same eval logits and log-probabilities. GPT-2 takes mcore's embedding scatter (learned positions),
    Llama the embedding's reduce-scatter, Qwen2-MoE (shared expert and its gate, a dense layer) the router
    under SP, its statistics summed over TP, with HF's load-balancing loss in the objective."""
    (ref_losses, ref_logits, ref_lp, ref_bal, ref_weights), = run_on_ranks(_run, 1, name, 1, STEPS)
    results = run_on_ranks(_run, 2, name, 2, STEPS)
    assert ref_losses[-1] < ref_losses[0]  # it learns: equal losses mean something
    for rank, (losses, logits, log_probs, balance, weights) in enumerate(results):
        # the trained weights: a norm's gradient left unsummed over TP moves it by about 1e-2 here
        assert weights.keys() == ref_weights.keys()
        for k, w in weights.items():
            assert (w - ref_weights[k]).abs().max().item() < 1e-5, f"rank {rank}: {k}"
        for step, (a, b) in enumerate(zip(losses, ref_losses)):
            assert abs(a - b) / abs(b) < 1e-5, f"rank {rank} step {step}: tp2+sp {a} vs tp1 {b}"
        assert logits.shape == ref_logits.shape
        assert (logits - ref_logits).abs().max().item() < 1e-4
        assert (log_probs - ref_lp).abs().max().item() < 1e-4
        if name.startswith("qwen2_moe"):
            assert all(abs(a - b) / b < 1e-5 for a, b in zip(balance, ref_bal)), (balance, ref_bal)
            assert all(b >= 1.0 - 1e-4 for b in balance)  # HF's loss: 1 when balanced, above otherwise


def test_base_model_hidden_states_under_sequence_parallelism():
    (ref, ref_grads), = run_on_ranks(_base_hidden, 1, 1)
    assert "h.0.attn.c_attn.weight" in ref_grads and "wte.weight" in ref_grads
    for hidden, grads in run_on_ranks(_base_hidden, 2, 2):
        assert hidden.shape == ref.shape == (2, 8, 64)
        assert (hidden - ref).abs().max().item() < 1e-5
        # a gather whose backward summed the ranks' (equal) gradients would double them
        assert grads.keys() == ref_grads.keys()
        for k, g in grads.items():
            assert (g - ref_grads[k]).abs().max().item() < 1e-5 * max(1.0, ref_grads[k].abs().max().item()), k


def _odd_length(tp):
    from megatron_plugin.errors import MegatronPluginConfigError

    try:
        _run("gpt2", tp, 2, seq_len=15)
    except MegatronPluginConfigError as err:
        return err.setting, str(err.value), err.fix
    return None


def test_sequence_length_not_a_multiple_of_tp_is_refused_on_every_rank():
    for got in run_on_ranks(_odd_length, 2, 2):
        assert got is not None, "a sequence of 15 tokens trained at TP=2 + SP"
        setting, _, fix = got
        assert setting == "sequence_parallelism"
        assert "multiple of tp_degree=2" in fix and "sequence_parallelism=False" in fix
