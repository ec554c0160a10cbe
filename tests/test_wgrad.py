"""layers/wgrad.py: the weight-gradient GEMM that accumulates into the fp32 main_grad (apex's
`fused_weight_gradient_mlp_cuda` on torch), and layers/compiled_linear.py: the parallel linear as
custom ops for compiled layers. Their bf16 paths (cuBLAS fp32 output, NCCL) are checked on GPU against
the unfused path (tests/gpu: test_gradient_accumulation_fusion_*); here their fp32 paths, compiled by
Inductor on CPU, under TP = 1 and 2 (gloo)."""

import os

import pytest
import torch

from megatron_plugin.layers import compiled_linear, wgrad
from tests.spawn import run_on_ranks


def _fused(x, w, b):
    return compiled_linear.parallel_linear(x, w, b, fuse_wgrad=True)


def test_fp32_wgrad_accumulates_into_main_grad():
    g = torch.Generator().manual_seed(0)
    grad_output = torch.randn(64, 24, generator=g)
    total_input = torch.randn(64, 16, generator=g)
    main_grad = torch.randn(24, 16, generator=g)
    expected = main_grad.double() + 2 * grad_output.double().t() @ total_input.double()
    storage = main_grad.data_ptr()
    for _ in range(2):  # two micro-batches
        wgrad.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
    assert main_grad.data_ptr() == storage  # in place: DDP's buffer, not a new tensor
    assert (main_grad.double() - expected).abs().max().item() < 1e-4


def test_install_supplies_the_extension_to_megatron_core():
    from megatron.core.tensor_parallel import layers

    from megatron_plugin import patches

    before = (layers._grad_accum_fusion_available, getattr(layers, "fused_weight_gradient_mlp_cuda", None))
    patches.install("wgrad_fusion")
    try:
        assert layers._grad_accum_fusion_available
        assert layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 is not None
        assert patches.install("wgrad_fusion") == []  # installed once; apex's own would also be left alone
    finally:
        patches.undo("wgrad_fusion")
    assert (layers._grad_accum_fusion_available, getattr(layers, "fused_weight_gradient_mlp_cuda", None)) == before


class _Block(torch.nn.Module):
    def __init__(self, bias):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(24, 16) * 0.1)
        self.bias = torch.nn.Parameter(torch.randn(24) * 0.1) if bias else None
        self.proj = torch.nn.Parameter(torch.randn(16, 24) * 0.1)

    def forward(self, x, linear):
        h = torch.nn.functional.gelu(linear(torch.nn.functional.layer_norm(x, (16,)), self.weight, self.bias))
        return x + linear(h, self.proj, None)


@pytest.mark.parametrize("fuse", [True, False])
def test_fused_linear_on_transposed_input_compiled(fuse):
    """The first layer gets [s, b, h] over [b, s, h] memory (the embedding's output, transposed): the
    backward's input gradient must have the strides its op's fake kernel promises, which the compiled
    code checks (it failed so on GPU before). Fused without TP, the input gradient is compiled with the
    layer; unfused (and under TP) it comes from the backward op."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(24, 16) * 0.1)
    w.main_grad = torch.zeros_like(w)
    x = torch.randn(3, 5, 16).transpose(0, 1).requires_grad_()
    step = torch.compile(lambda x: compiled_linear.parallel_linear(x * 2, w, None, fuse_wgrad=fuse),
                         backend="inductor", fullgraph=True)
    step(x).square().sum().backward()
    xp, wp = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.nn.functional.linear(xp * 2, wp).square().sum().backward()
    assert (x.grad - xp.grad).abs().max().item() < 1e-5
    assert ((w.main_grad if fuse else w.grad) - wp.grad).abs().max().item() < 1e-5


def test_fused_linear_compiled_accumulates_into_main_grad():
    """What a compiled layer runs with gradient_accumulation_fusion (layers/linear.py): Inductor compiles
    the block with the linears as opaque ops; over two micro-batches main_grad gathers the weight
    gradients of plain autograd, autograd hands the hook the placeholder, and input/bias gradients match."""
    torch.manual_seed(0)
    for bias in (True, False):
        fused, plain = _Block(bias), _Block(bias)
        plain.load_state_dict(fused.state_dict())
        weights = [fused.weight, fused.proj]
        for w in weights:
            w.main_grad = torch.zeros_like(w)
        fused.proj.zero_out_wgrad = True  # as mcore marks a weight tied to the embedding
        step = torch.compile(fused.forward, backend="inductor", fullgraph=True)  # fullgraph: no graph break
        for _ in range(2):
            x = torch.randn(3, 5, 16)
            xf, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
            step(xf, _fused).square().sum().backward()
            plain(xp, torch.nn.functional.linear).square().sum().backward()
            assert (xf.grad - xp.grad).abs().max().item() < 1e-5
        for w, ref in ((fused.weight, plain.weight), (fused.proj, plain.proj)):
            assert w.grad_added_to_main_grad
            assert (w.main_grad - ref.grad).abs().max().item() < 1e-5
        assert torch.equal(fused.proj.grad, torch.zeros_like(fused.proj))  # the hook adds nothing for it
        if bias:
            assert (fused.bias.grad - plain.bias.grad).abs().max().item() < 1e-5


def test_fused_linear_without_main_grad_says_so():
    w = torch.nn.Parameter(torch.randn(4, 4))
    out = _fused(torch.randn(2, 4), w, None)
    try:
        out.sum().backward()
    except RuntimeError as e:
        assert "main_grad" in str(e)
    else:
        raise AssertionError("a fused linear without main_grad trained silently")


def _compile_with_linear_ops(layers):
    """What the GPU engine does with gradient_accumulation_fusion=True and compiled layers, on CPU: the
    linears fuse their weight gradients into main_grad (a zeroed buffer here, DDP's on GPU), and each
    layer is compiled by Inductor."""
    for layer in layers:
        layer.config.gradient_accumulation_fusion = True  # one config object for every layer
        for m in layer.modules():
            if hasattr(m, "gradient_accumulation_fusion"):
                m.gradient_accumulation_fusion = True
                m.weight.main_grad = torch.zeros_like(m.weight)
        layer.compile(backend="inductor")


def _compiled_ops_worker(family):
    """A Megatron model built from HF weights twice: eager with autograd's gradients, and with its
    transformer layers compiled (Inductor), running their linears as `compiled_linear` ops that
    accumulate weight gradients into main_grad (column/row-parallel, with the TP all-reduces as ops
    under TP = 2). Two backward passes (micro-batches)."""
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.engine.gpu import transformer_layers
    from megatron_plugin.models.modeling import MegatronModel
    from tests.models import tiny_gpt2, tiny_llama

    import torch._dynamo.utils as du

    # the pool's worker processes serve other tests first: their compiled layers' cache entries (the same
    # TransformerLayer.forward code) count toward dynamo's recompile limit; start clean, count this test's breaks
    torch._dynamo.reset()
    du.counters.clear()
    plugin = MegatronLMPlugin(tp_degree=int(os.environ["WORLD_SIZE"]))
    hf = tiny_gpt2() if family == "gpt2" else tiny_llama()
    initialize(plugin, hf.config)
    eager, ops = (MegatronModel.from_hf(hf, plugin) for _ in range(2))
    _compile_with_linear_ops(transformer_layers(ops.module))
    g = torch.Generator().manual_seed(2)
    losses = {"eager": [], "ops": []}
    for _ in range(2):
        ids = torch.randint(0, hf.config.vocab_size, (2, 10), generator=g)
        labels = torch.roll(ids, -1, dims=1)
        for name, model in (("eager", eager), ("ops", ops)):
            loss = model(ids, labels=labels).mean()
            loss.backward()
            losses[name].append(loss.item())
    worst = 0.0
    fused = 0
    for (name, p), (_, q) in zip(eager.module.named_parameters(), ops.module.named_parameters()):
        got = q.main_grad if hasattr(q, "main_grad") else q.grad
        fused += hasattr(q, "main_grad")
        worst = max(worst, ((got - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item())
    breaks = sum(du.counters["graph_break"].values())
    return {"losses": losses, "worst_grad_rel": worst, "fused": fused, "graph_breaks": breaks}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_compiled_layers_with_linear_ops_match_eager_gradients(family, world_size):
    for res in run_on_ranks(_compiled_ops_worker, world_size, family):
        assert res["fused"] >= 4 * 2, res  # qkv, proj, fc1, fc2 of each of the 2 layers
        for a, b in zip(res["losses"]["ops"], res["losses"]["eager"]):
            assert abs(a - b) <= 1e-5 * abs(b), res
        assert res["worst_grad_rel"] < 1e-4, res
        assert res["graph_breaks"] == 0, res  # the linears and TP sums stay inside the compiled graphs


def _sequence_parallel_ops_worker(cpp_wrapper=False, overlap=False):
    """Sequence parallelism through the ops (all-gather of the input, reduce-scatter of the input
    gradient and of the row-parallel sum) against plain TP = 2 without it, on the transformer block:
    the CPU engine itself refuses SP, since mcore's embedding and buffers gather on CUDA."""
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()  # a pooled worker may hold these layers compiled under the other wrapper
    inductor_config.cpp_wrapper = cpp_wrapper  # process-wide, as engine/gpu.use_cpp_wrapper sets it
    try:
        return _sequence_parallel_ops_run(overlap)
    finally:
        inductor_config.cpp_wrapper = False
        torch._dynamo.reset()


def _sequence_parallel_ops_run(overlap):
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.models.modeling import MegatronModel
    from tests.models import tiny_gpt2

    hf = tiny_gpt2()
    sp_plugin = MegatronLMPlugin(tp_degree=2, sequence_parallelism=True)
    initialize(sp_plugin, hf.config)
    plain = MegatronModel.from_hf(hf, MegatronLMPlugin(tp_degree=2)).module.decoder
    sp = MegatronModel.from_hf(hf, sp_plugin).module.decoder
    _compile_with_linear_ops(sp.layers)
    # Megatron's tp_comm_overlap (other_megatron_args): the SP collectives fused with their GEMMs, here through
    # torch's reference of its symmetric-memory ops (the GPU runs the ops themselves); counted to show they ran
    sp.layers[0].config.tp_comm_overlap = overlap
    calls = {"ag_matmul": 0, "matmul_rs": 0}
    reals = {name: getattr(compiled_linear, "_" + name) for name in calls}
    for name, real in reals.items():

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        setattr(compiled_linear, "_" + name, counted)
    # the backward's gathers of the input for the weight gradient: issued asynchronously (they run under the
    # input gradient's GEMM, as mcore's), and not at all for a frozen weight
    import torch.distributed as dist

    gathers, real_gather = [], dist.all_gather_into_tensor

    def gather(*args, **kwargs):
        gathers.append(bool(kwargs.get("async_op")))
        return real_gather(*args, **kwargs)

    dist.all_gather_into_tensor = gather
    try:
        res = _sequence_parallel_ops_compare(hf, plain, sp)
        res["async_gathers"], res["sync_gathers"] = gathers.count(True), gathers.count(False)
        res["calls"] = dict(calls)
        res["frozen"] = _frozen_column_backward(sp.layers[0].config, gathers)
    finally:  # the process serves later tasks (tests/spawn.py)
        dist.all_gather_into_tensor = real_gather
        for name, real in reals.items():
            setattr(compiled_linear, "_" + name, real)
    return res


def _frozen_column_backward(config, gathers):
    """A column linear's backward under SP for a trained and a frozen weight: the same input gradient, and the
    frozen one gathers nothing (`gathers` counts all-gathers)."""
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group().group_name
    g = torch.Generator().manual_seed(5)
    x, w, go = torch.randn(4, 2, 8, generator=g), torch.randn(6, 8, generator=g), torch.randn(8, 2, 6, generator=g)
    overlap = bool(config.tp_comm_overlap)
    out = {}
    for need_wgrad in (True, False):
        before = len(gathers)
        grads = compiled_linear._linear_backward(go, x, w, group, True, compiled_linear.DGRAD_REDUCE_SCATTER,
                                                 False, False, need_wgrad, overlap)
        out[need_wgrad] = (grads[0], len(gathers) - before)
    return {"same_dinput": torch.equal(out[True][0], out[False][0]), "gathers_trained": out[True][1],
            "gathers_frozen": out[False][1]}


def _sequence_parallel_ops_compare(hf, plain, sp):
    import torch.distributed as dist
    from megatron.core import parallel_state

    rank, group = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()
    g = torch.Generator().manual_seed(4)
    h = torch.randn(8, 2, hf.config.n_embd, generator=g)
    r = torch.randn(8, 2, hf.config.n_embd, generator=g)
    hp, hs = h.clone().requires_grad_(), h.chunk(2)[rank].clone().requires_grad_()

    def run(block, x):  # the block's layers and final norm (the block itself forks the CUDA RNG under SP)
        for layer in block.layers:
            x = layer(hidden_states=x, attention_mask=None)[0]
        return block.final_layernorm(x)

    out_p, out_s = run(plain, hp), run(sp, hs)
    (out_p * r).sum().backward()
    (out_s * r.chunk(2)[rank]).sum().backward()
    res = {"out": (out_s - out_p.chunk(2)[rank]).abs().max().item(),
           "dinput": (hs.grad - hp.grad.chunk(2)[rank]).abs().max().item()}
    worst = 0.0
    for (name, p), (_, q) in zip(plain.named_parameters(), sp.named_parameters()):
        got = q.main_grad if hasattr(q, "main_grad") else q.grad.clone()
        if getattr(q, "sequence_parallel", False):  # replicated over TP: each rank saw its part of the sequence
            dist.all_reduce(got, group=group)
        worst = max(worst, ((got - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item())
    res["worst_grad_rel"] = worst
    return res


@pytest.mark.parametrize("cpp_wrapper,overlap", [(False, False), (True, False), (False, True)],
                         ids=["python_wrapper", "cpp_wrapper", "tp_comm_overlap"])
def test_sequence_parallel_linear_ops_match_plain_tensor_parallel(cpp_wrapper, overlap):
    """cpp_wrapper: the TP ops (a group name, flags, a list of tensors back) called from Inductor's C++ wrapper,
    which the GPU engine gives layers without collectives in them (engine/gpu.wants_cpp_wrapper).
    tp_comm_overlap: the column linears' gather + GEMM and the row linears' GEMM + reduce-scatter as one op each
    way (2 layers x 2 of each, forward and backward)."""
    for res in run_on_ranks(_sequence_parallel_ops_worker, 2, cpp_wrapper, overlap):
        assert res["out"] < 1e-5 and res["dinput"] < 1e-5, res
        assert res["worst_grad_rel"] < 1e-4, res
        # forward: qkv, fc1 gathered-and-multiplied, proj, fc2 multiplied-and-scattered; backward the other way
        assert res["calls"] == ({"ag_matmul": 8, "matmul_rs": 8} if overlap else {"ag_matmul": 0, "matmul_rs": 0}), res
        # backward: each column linear (qkv, fc1; 2 layers) gathers its input for the weight gradient asynchronously;
        # the forward's gathers (and the row linears' output-gradient gathers) are waited on where they are issued
        assert res["async_gathers"] == 4, res
        assert res["sync_gathers"] == (0 if overlap else 8), res
        assert res["frozen"] == {"same_dinput": True, "gathers_trained": 1, "gathers_frozen": 0}, res


def _silent_in_codegen_worker():
    """Every TP op of compiled_linear as Inductor's codegen would run it (its C++ wrapper's tuning run), with
    torch.distributed's collectives made to raise: shapes as the fakes say, no collective, main_grad untouched."""
    import torch.distributed as dist

    def refuse(*args, **kwargs):
        raise AssertionError("a collective inside Inductor's codegen")

    from megatron.core import parallel_state

    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from tests.models import tiny_gpt2

    initialize(MegatronLMPlugin(tp_degree=2), tiny_gpt2().config)
    group = parallel_state.get_tensor_model_parallel_group().group_name
    x, w = torch.randn(4, 3, 8), torch.randn(6, 8)
    w.main_grad = torch.zeros(6, 8)
    saved = {n: getattr(dist, n) for n in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")}
    real, real_symm = compiled_linear.in_inductor_codegen, compiled_linear._symm_mem
    try:
        for n in saved:
            setattr(dist, n, refuse)
        compiled_linear._symm_mem = refuse  # tp_comm_overlap's fused ops
        compiled_linear.in_inductor_codegen = lambda: True
        shapes = [tuple(compiled_linear._gather_seq(x, group).shape),
                  tuple(compiled_linear._reduce_scatter_seq(x, group).shape),
                  tuple(compiled_linear._all_reduce(x, group).shape)]
        for dgrad in (compiled_linear.DGRAD_ALL_REDUCE, compiled_linear.DGRAD_REDUCE_SCATTER):
            go = torch.randn(8 if dgrad == compiled_linear.DGRAD_REDUCE_SCATTER else 4, 3, 6)
            grads = compiled_linear._linear_backward(go, x, w, group, dgrad == compiled_linear.DGRAD_REDUCE_SCATTER,
                                                     dgrad, True, True, True)
            shapes.append([tuple(g.shape) for g in grads])
        # tp_comm_overlap: column forward and backward, row forward and backward
        shapes.append(tuple(compiled_linear._ag_linear(x, w, group).shape))
        go = torch.randn(8, 3, 6)
        shapes.append([tuple(g.shape) for g in compiled_linear._linear_backward(
            go, x, w, group, True, compiled_linear.DGRAD_REDUCE_SCATTER, True, True, True, True)])
        x_row, w_row = torch.randn(8, 3, 6), torch.randn(8, 6)
        w_row.main_grad = torch.zeros(8, 6)
        shapes.append(tuple(compiled_linear._linear_rs(x_row, w_row, group).shape))
        shapes.append([tuple(g.shape) for g in compiled_linear._linear_rs_backward(
            torch.randn(4, 3, 8), x_row, w_row, group, True, True)])
    finally:
        compiled_linear.in_inductor_codegen, compiled_linear._symm_mem = real, real_symm
        for n, f in saved.items():
            setattr(dist, n, f)
    return {"shapes": shapes, "main_grad_untouched": bool((w.main_grad == 0).all() and (w_row.main_grad == 0).all())}


def test_tp_ops_do_not_communicate_inside_inductor_codegen():
    for res in run_on_ranks(_silent_in_codegen_worker, 2):
        assert res["shapes"] == [(8, 3, 8), (2, 3, 8), (4, 3, 8),
                                 [(4, 3, 8), (6, 8), (6,)], [(4, 3, 8), (6, 8), (6,)],
                                 (8, 3, 6), [(4, 3, 8), (6, 8), (6,)], (4, 3, 8), [(8, 3, 6), (8, 6)]], res
        assert res["main_grad_untouched"], res


class _BufferedParams:
    """What the GPU engine's DDP gives the parameters, on CPU: one flat fp32 gradient buffer (with
    padding at its end, as DDP's buckets have) holding each parameter's main_grad, and DDP's hook, which
    adds a parameter's autograd gradient into main_grad unless the backward put it there itself. The
    buffer starts full of NaN: whatever the step neither writes nor zeroes shows up."""

    def __init__(self, module):
        self.module = module
        self.config = module.config
        self.params_with_grad = [p for p in module.parameters() if p.requires_grad]
        total = sum(p.numel() for p in self.params_with_grad)
        self.grad_data = torch.full((total + 7,), float("nan"))
        index, start = {}, 0
        for p in self.params_with_grad:
            index[p] = (start, start + p.numel(), 0)
            p.main_grad = self.grad_data[start:start + p.numel()].view_as(p)
            p.grad_added_to_main_grad = False
            p.register_post_accumulate_grad_hook(self._hook)
            start += p.numel()
        self.buffers = [type("Buffer", (), dict(param_index_map=index, grad_data=self.grad_data))]
        self.expert_parallel_buffers, self.bucket_groups, self.expert_parallel_bucket_groups = [], [], []
        self.hook_adds = []

    def _hook(self, p):  # mcore's DistributedDataParallel._make_backward_post_hook
        if not p.grad_added_to_main_grad or getattr(p, "zero_out_wgrad", False):
            p.main_grad.add_(p.grad)
            self.hook_adds.append(p)
        p.grad = None


def _grads_into_main_grad_worker(name, fused=True):
    """A Megatron model built from HF weights twice: plain autograd, and as the GPU engine trains with
    gradient_accumulation_fusion: linears writing their first weight gradient of a step into a buffer
    that was not zeroed (engine/grad_buffers.py), the word embedding's lookup adding its rows into
    main_grad (layers/embedding.py). Without the fusion (`fused=False`) every gradient goes through DDP's
    hook into a buffer zeroed whole. Two steps of two micro-batches, TP = 1 or 2."""
    from megatron_plugin import MegatronLMPlugin
    from megatron_plugin.engine.distributed import initialize
    from megatron_plugin.engine.gpu import transformer_layers
    from megatron_plugin.engine.grad_buffers import GradBufferReset, written_first_by_gemm
    from megatron_plugin.models.modeling import MegatronModel
    from tests.models import tiny_gpt2, tiny_llama

    plugin = MegatronLMPlugin(tp_degree=int(os.environ["WORLD_SIZE"]))
    hf = tiny_gpt2() if name == "gpt2" else tiny_llama(name)
    initialize(plugin, hf.config)
    eager, model = (MegatronModel.from_hf(hf, plugin) for _ in range(2))
    module = model.module
    if fused:
        module.config.gradient_accumulation_fusion = True  # one config object for the whole model
        for m in module.modules():
            if hasattr(m, "gradient_accumulation_fusion"):
                m.gradient_accumulation_fusion = True
        # the linears' fused weight gradient runs as ops inside compiled code on CPU (mcore's eager one
        # allocates its placeholder on CUDA)
        for m in [*transformer_layers(module), module.output_layer]:
            m.compile(backend="aot_eager")
    ddp = _BufferedParams(module)
    reset = GradBufferReset(ddp)
    embedding = module.embedding.word_embeddings.weight
    res = {"tied": module.share_embeddings_and_output_weights, "worst_grad_rel": 0.0, "written_first": 0,
           "gaps_zeroed": True, "embedding_added_by_hook": False}
    g = torch.Generator().manual_seed(3)
    for step in range(2):
        reset.reset()
        res["gaps_zeroed"] &= all(bool((gap == 0).all()) for gap in reset.gaps)
        res["written_first"] = len(reset.marked)
        eager.module.zero_grad(set_to_none=True)
        for _ in range(2):
            ids = torch.randint(0, hf.config.vocab_size, (2, 10), generator=g)
            labels = torch.roll(ids, -1, dims=1)
            for m in (eager, model):
                m(ids, labels=labels).mean().backward()
        reset.zero_unwritten()
        res["embedding_added_by_hook"] |= any(p is embedding for p in ddp.hook_adds)
        for (_, p), (_, q) in zip(eager.module.named_parameters(), module.named_parameters()):
            err = ((q.main_grad - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item()
            res["worst_grad_rel"] = max(res["worst_grad_rel"], err if err == err else float("inf"))  # NaN
    res["expected_written_first"] = len(written_first_by_gemm(module))
    res["padding"] = ddp.grad_data[-7:].tolist()
    return res


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", ["gpt2", "llama", "llama_tied_linear"])
def test_gradients_written_into_unzeroed_buffers(name, world_size):
    """The main_grads equal autograd's gradients, though the buffer started each step as NaN except where
    the engine zeroes it; the embedding's gradient never passes through DDP's hook (tied or not)."""
    for res in run_on_ranks(_grads_into_main_grad_worker, world_size, name):
        assert res["tied"] == (name != "llama"), res
        # qkv, proj, fc1, fc2 of 2 layers, the output layer (its own weight, or the tied embedding)
        assert res["written_first"] == res["expected_written_first"] == 9, res
        assert res["gaps_zeroed"] and res["padding"] == [0.0] * 7, res
        assert res["worst_grad_rel"] < 1e-4, res
        assert not res["embedding_added_by_hook"], res


def test_other_ranks_ids_do_not_pile_onto_one_row():
    """Under TP the lookup into main_grad sends another rank's ids to some row of its own part (their output and
    gradient are zero): spread as the ids spread, not all onto row 0 (mcore's choice), where the backward's sorted
    index_put_ adds them one after another (5.5 ms a step at 774M on an H200)."""
    from megatron_plugin.layers.embedding import local_rows

    ids = torch.tensor([[5, 6, 7, 4, 5, 1], [0, 3, 6, 7, 2, 5]])  # vocabulary 8 over TP = 2: rows 0-3 and 4-7
    rows0, outside0 = local_rows(ids, 0, 4)
    rows1, outside1 = local_rows(ids, 4, 4)
    assert torch.equal(outside0, ids >= 4) and torch.equal(outside1, ids < 4)
    assert torch.equal(rows0[~outside0], ids[~outside0]) and torch.equal(rows1[~outside1], ids[~outside1] - 4)
    # each id at its place in its own rank's part: rank 0's busiest row takes 4 lookups, where row 0 took 9
    assert rows0.tolist() == [[1, 2, 3, 0, 1, 1], [0, 3, 2, 3, 2, 1]], rows0
    assert rows1.tolist() == [[1, 2, 3, 0, 1, 1], [0, 3, 2, 3, 2, 1]], rows1
    assert torch.bincount(rows0.flatten()).max() == 4 and int(outside0.sum()) == 8


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_without_fusion_the_whole_buffer_is_zeroed(name):
    """The same reset without gradient_accumulation_fusion marks nothing, zeroes every buffer, and the
    hook-added gradients equal autograd's."""
    for res in run_on_ranks(_grads_into_main_grad_worker, 1, name, False):
        assert res["written_first"] == res["expected_written_first"] == 0, res
        assert res["gaps_zeroed"] and res["padding"] == [0.0] * 7, res
        assert res["worst_grad_rel"] < 1e-4, res
        assert res["embedding_added_by_hook"], res
