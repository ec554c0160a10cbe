"""Megatron's full-iteration CUDA graph (engine/full_graph.py): the settings, where they are refused, and the replay
bookkeeping (static batches, shapes, moved weights, results out of the graph's memory). The capture and replay
themselves need CUDA: tests/gpu/test_full_graph_gpu.py trains with them against the eager step."""

import pytest
import torch

from megatron_plugin import MegatronLMPlugin
from megatron_plugin.engine.full_graph import FullIterationGraph, batch_layout
from megatron_plugin.errors import MegatronPluginConfigError
from megatron_plugin.plugin import check_full_iteration_graph, full_iteration_graph
from tests.test_plugin import clean_env  # noqa: F401  (the fixture: no MEGATRON_LM_* variables)

FULL = {"cuda_graph_impl": "local", "cuda_graph_scope": "full_iteration"}



def test_megatron_names_turn_it_on_with_megatrons_warmup(clean_env):
    assert full_iteration_graph(MegatronLMPlugin()) is None
    assert full_iteration_graph(MegatronLMPlugin(other_megatron_args={"cuda_graph_impl": "none"})) is None
    assert full_iteration_graph(MegatronLMPlugin(other_megatron_args=FULL)) == 3  # TransformerConfig's default
    assert full_iteration_graph(MegatronLMPlugin(other_megatron_args={**FULL, "cuda_graph_warmup_steps": 1})) == 1
    assert full_iteration_graph(MegatronLMPlugin(other_megatron_args={**FULL, "cuda_graph_scope": ["full_iteration"]})) == 3
    from megatron.core.transformer.enums import CudaGraphScope

    for scope in (CudaGraphScope.full_iteration, [CudaGraphScope.full_iteration]):  # as TransformerConfig takes it
        assert full_iteration_graph(MegatronLMPlugin(other_megatron_args={**FULL, "cuda_graph_scope": scope})) == 3


def test_the_graphs_settings_stay_out_of_transformer_config():
    """With cuda_graph_impl='local' megatron-core's blocks would build per-layer graph managers (which set a new CUDA
    stream for the whole process): the engine reads the settings, the config never sees them."""
    from megatron_plugin.models.gpt import transformer_config_overrides

    args = {**FULL, "cuda_graph_warmup_steps": 2, "attention_dropout": 0.0}
    assert transformer_config_overrides(args) == {"attention_dropout": 0.0}


@pytest.mark.parametrize("args, setting, words", [
    ({"cuda_graph_impl": "transformer_engine", "cuda_graph_scope": "full_iteration"}, "cuda_graph_impl",
     "'local' or 'none'.*reduce-overhead"),
    ({"cuda_graph_impl": "local"}, "cuda_graph_scope", "'full'.*only 'full_iteration'"),
    ({"cuda_graph_impl": "local", "cuda_graph_scope": "attn,mlp"}, "cuda_graph_scope", "only 'full_iteration'"),
    ({**FULL, "cuda_graph_warmup_steps": 0}, "cuda_graph_warmup_steps", "int >= 1"),
    ({"enable_cuda_graph": True}, "enable_cuda_graph", "deprecated.*'full_iteration'"),
    ({"cuda_graph_scope": "full_iteration"}, "cuda_graph_scope", "takes effect with cuda_graph_impl='local'"),
])
def test_other_cuda_graph_settings_refused_at_the_plugin(clean_env, args, setting, words):
    with pytest.raises(MegatronPluginConfigError, match=rf"other_megatron_args\['{setting}'\].*{words}"):
        MegatronLMPlugin(other_megatron_args=args)


def test_refused_where_a_replay_would_be_wrong_or_is_untested(clean_env):
    def plugin(**kw):
        return MegatronLMPlugin(other_megatron_args=FULL, **kw)

    compiled = {"backend": "inductor"}
    check_full_iteration_graph(plugin(tp_degree=2, sequence_parallelism=True), "cuda", compiled, "bf16", moe=False)
    check_full_iteration_graph(plugin(), "cuda", None, "no", moe=False)  # eager layers too
    check_full_iteration_graph(plugin(fp8="hybrid"), "cuda", compiled, "bf16", moe=False)  # FP8 linears too
    check_full_iteration_graph(MegatronLMPlugin(fp8="hybrid"), "cuda", compiled, "fp16", moe=True)  # graph off
    refusals = [
        ((plugin(), "cpu", None, "no", False), "needs the CUDA engine"),
        ((plugin(pp_degree=2), "cuda", compiled, "bf16", False), "pp_degree=2.*set pp_degree=1"),
        ((plugin(context_parallel_size=2), "cuda", compiled, "bf16", False), "context_parallel_size=2"),
        ((plugin(), "cuda", compiled, "bf16", True), "an MoE model"),
        ((plugin(), "cuda", compiled, "bf16", False, "t5"), "the t5 family.*decoder-only models are"),
        ((plugin(), "cuda", compiled, "fp16", False), "mixed_precision='fp16'.*use bf16"),
        ((plugin(recompute_activations=True), "cuda", compiled, "bf16", False), "recompute_granularity='selective'"),
        ((plugin(calculate_per_token_loss=True), "cuda", compiled, "bf16", False),
         "calculate_per_token_loss=True.*token count on the host"),
        ((MegatronLMPlugin(tp_degree=2, sequence_parallelism=True, other_megatron_args={**FULL, "tp_comm_overlap": True}),
          "cuda", compiled, "bf16", False), r"other_megatron_args\['tp_comm_overlap'\].*symmetric-memory workspace"),
        ((plugin(optimizer_cpu_offload=True, use_distributed_optimizer=True), "cuda", compiled, "bf16", False),
         "optimizer_cpu_offload=True"),
        ((plugin(), "cuda", {"backend": "inductor", "mode": "reduce-overhead"}, "bf16", False),
         "'reduce-overhead'.*use the default mode"),
    ]
    for (p, device, kwargs, precision, moe, *family), words in refusals:
        with pytest.raises(MegatronPluginConfigError,
                           match=r"other_megatron_args\['cuda_graph_scope'\]='full_iteration': not with .*" + words
                           + r".*remove cuda_graph_impl / cuda_graph_scope" if device == "cuda" else words):
            check_full_iteration_graph(p, device, kwargs, precision, moe=moe, encoder_family=(family or [None])[0])


class _ReplayOnCPU(FullIterationGraph):
    """The bookkeeping of FullIterationGraph with a stand-in for the CUDA graph: `capture` keeps the schedule, and
    a replay runs it again on the static batches, writing into the captured result tensors in place, as a graph's
    replay overwrites its outputs."""

    def _capture(self, micro_batches, schedule, step):
        from megatron_plugin.engine import full_graph

        static = full_graph._static_copy(micro_batches, "cpu")
        result = schedule(static)

        class Replay:
            def replay(self):
                for old, fresh in zip(result, schedule(static)):
                    for k in old:
                        old[k].copy_(fresh[k])

            def reset(self):
                pass

        return full_graph.Captured(Replay(), static, result, step, held=[])


def _schedule(calls):
    def run(mbs):
        calls.append([(mb["input_ids"].data_ptr(), mb["input_ids"].clone(), vars(mb["attention_mask"]).copy())
                      for mb in mbs])
        return [{"loss": mb["input_ids"].float().mean().reshape(())} for mb in mbs]
    return run


def _batch(value, n=2, shape=(2, 8), padded=False):
    from megatron_plugin.layers.masks import KNOWN

    out = []
    for i in range(n):
        mask = torch.ones(shape, dtype=torch.long)
        setattr(mask, KNOWN, not padded)  # the batch check's fact: no padding
        out.append({"input_ids": torch.full(shape, value + i), "attention_mask": mask, "note": None})
    return out


def test_replays_read_each_new_batch_and_return_their_own_results():
    weight = torch.nn.Parameter(torch.zeros(4))
    places = [weight]
    g = _ReplayOnCPU(2, torch.device("cpu"), places=lambda: places, generators=lambda: [])
    calls = []
    sched = _schedule(calls)
    outs = [g.run(_batch(10 * s), sched, step=s + 1) for s in range(5)]
    assert (g.eager_steps, g.captures, g.replays) == (2, 1, 3)
    # each step's result is its own batch's, also after later replays overwrote the graph's outputs
    assert [[o["loss"].item() for o in out] for out in outs] == [[10 * s, 10 * s + 1] for s in range(5)]
    # the replays ran on the captured buffers, refilled with each step's batch, with the batch check's facts
    assert len({c[0][0] for c in calls[2:]}) == 1 and calls[2][0][0] != calls[1][0][0]
    assert calls[-1][1][1].eq(41).all() and calls[-1][1][2] == vars(_batch(0)[0]["attention_mask"])

    # a new layout (another length; the same length with padding) runs eagerly once, is captured the next time;
    # the first layout's graph still replays
    for shape, padded in (((2, 7), False), ((2, 8), True)):
        out = g.run(_batch(50, shape=shape, padded=padded), sched, step=6)
        assert (g.eager_steps, out[1]["loss"].item()) == (3 if shape == (2, 7) else 4, 51)
        out = g.run(_batch(60, shape=shape, padded=padded), sched, step=7)
        assert out[1]["loss"].item() == 61 and calls[-1][0][2] == vars(_batch(0, padded=padded)[0]["attention_mask"])
    assert g.captures == 3
    replays = g.replays
    assert g.run(_batch(70), sched, step=8)[0]["loss"].item() == 70 and g.replays == replays + 1

    # a weight that moved (offloaded and brought back): the steps are captured again at its new place
    places[0] = torch.nn.Parameter(torch.zeros(4))
    out = g.run(_batch(100), sched, step=9)
    assert (g.captures, out[1]["loss"].item()) == (4, 101)


def test_new_host_state_runs_eagerly_once_then_is_captured():
    # FP8's delayed scaling settles after the first step, which changes the FP8 layers' code: a step of the new
    # state is not captured before it has run (and compiled) once outside a capture
    g = _ReplayOnCPU(1, torch.device("cpu"), places=lambda: [], generators=lambda: [])
    sched = _schedule([])
    states = [(3,), (0,), (0,), (0,)]
    outs = [g.run(_batch(10 * s), sched, step=s + 1, host_state=h) for s, h in enumerate(states)]
    assert (g.eager_steps, g.captures, g.replays) == (2, 1, 2)
    assert [o[0]["loss"].item() for o in outs] == [0, 10, 20, 30]
    # a graph of an earlier host state goes once the state moves on (it would never replay again)
    g.run(_batch(40), sched, step=5, host_state=(5,))
    assert len(g._captured) == 0 and g.eager_steps == 3


def test_layouts_beyond_the_limit_run_eagerly_and_say_so(caplog):
    from megatron_plugin.engine.full_graph import MAX_GRAPHS

    g = _ReplayOnCPU(1, torch.device("cpu"), places=lambda: [], generators=lambda: [])
    sched = _schedule([])
    for length in range(2, 3 + MAX_GRAPHS):
        for _ in range(2):
            out = g.run(_batch(length, shape=(1, length)), sched, step=0)
            assert out[0]["loss"].item() == length
    assert g.captures == MAX_GRAPHS and g.eager_steps == MAX_GRAPHS + 2
    assert "more than 4 layouts" in caplog.text and "Pad batches to one length" in caplog.text


def test_batch_layout_sees_shapes_dtypes_facts_and_other_values():
    a = batch_layout(_batch(0))
    assert a == batch_layout(_batch(5))  # values do not matter
    assert a != batch_layout([{**mb, "input_ids": mb["input_ids"].int()} for mb in _batch(0)])
    assert a != batch_layout([{**mb, "note": 1} for mb in _batch(0)])
    assert a != batch_layout(_batch(0, padded=True))


def test_post_training_steps_refused_with_the_graph(clean_env):
    """Their coefficients change as scripts train; a replay would keep the captured ones."""
    import train_steps
    from megatron_plugin.resolve import check_graph_step

    graph = MegatronLMPlugin(other_megatron_args=FULL)
    check_graph_step(graph, train_steps.GPTTrainStep)
    check_graph_step(MegatronLMPlugin(), train_steps.DPOTrainStep)
    for step in (train_steps.DPOTrainStep, train_steps.PolicyGradientTrainStep):
        with pytest.raises(MegatronPluginConfigError, match=rf"'full_iteration': not with {step.__name__}: .*kl_coef, beta"):
            check_graph_step(graph, step)


def test_a_graph_holds_megatron_cores_shared_buffer(monkeypatch):
    """megatron-core's SP linears gather into one shared buffer that a larger request replaces: each captured graph
    holds the one it writes into, so that memory is not handed to anything else while replays write there."""
    from megatron.core import parallel_state
    from megatron.core.utils import GlobalMemoryBuffer

    from megatron_plugin.engine.full_graph import _buffers_in_use

    monkeypatch.setattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    assert _buffers_in_use() == []
    buffer = GlobalMemoryBuffer()
    buffer.buffer[("mpu", torch.bfloat16)] = first = torch.empty(8, dtype=torch.bfloat16)
    monkeypatch.setattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", buffer)
    held = _buffers_in_use()
    buffer.buffer[("mpu", torch.bfloat16)] = torch.empty(16, dtype=torch.bfloat16)  # a larger request replaced it
    assert len(held) == 1 and held[0] is first


def test_process_teardown_drops_every_graph_before_the_groups_go(monkeypatch):
    # NCCL destroys a communicator only after every graph that captured its work is gone: a graph left alive made
    # destroy_process_group wait forever (two H200s, 2026-11-30). distributed.destroy (our harness, the atexit
    # path) and Accelerator.end_training release every engine's graphs first.
    from megatron_plugin.engine import distributed

    resets, order = [], []

    class Recorded(_ReplayOnCPU):
        def _capture(self, micro_batches, schedule, step):
            entry = super()._capture(micro_batches, schedule, step)
            entry.graph.reset = lambda: resets.append(step)
            return entry

    graphs = [Recorded(1, torch.device("cpu"), places=lambda: [], generators=lambda: []) for _ in range(2)]
    sched = _schedule([])
    for g in graphs:
        for s in range(3):
            g.run(_batch(s), sched, step=s)
        assert g.captures == 1 and len(g._captured) == 1
    monkeypatch.setattr(distributed, "release_model_parallel", lambda: order.append(("groups", len(resets))))
    distributed.destroy()
    assert resets == [1, 1] and order == [("groups", 2)]  # both graphs reset, before megatron-core's groups went
    assert all(not g._captured for g in graphs)
    # a step after the release (a second training phase) captures again, eager steps not repeated
    out = graphs[0].run(_batch(7), sched, step=9)
    assert out[0]["loss"].item() == 7 and graphs[0].captures == 2 and graphs[0].eager_steps == 1


def test_a_second_seeding_keeps_each_tracker_stream_object():
    """A second `prepare` seeds megatron-core's graph-safe tracker again, which makes new generators; an engine's
    captured graph keeps advancing the ones it registered. `keep_generators` puts the registered objects back,
    re-seeded as the new ones were: one stream per name, starting where the new seeding starts it."""
    from types import SimpleNamespace

    from megatron_plugin.engine.distributed import keep_generators

    registered = torch.Generator().manual_seed(7)
    torch.rand(5, generator=registered)  # a first engine's steps advanced it
    fresh = torch.Generator().manual_seed(1234)
    plain = torch.zeros(3)  # a tracker of the other kind holds state tensors: left as they are
    tracker = SimpleNamespace(states_={"model-parallel-rng": fresh, "data-parallel-rng": plain,
                                       "expert-parallel-rng": torch.Generator().manual_seed(99)})
    keep_generators({"model-parallel-rng": registered, "data-parallel-rng": torch.ones(3)}, tracker)
    assert tracker.states_["model-parallel-rng"] is registered
    assert tracker.states_["data-parallel-rng"] is plain
    assert tracker.states_["expert-parallel-rng"].initial_seed() == 99  # new name: the new object stays
    expected = torch.rand(4, generator=torch.Generator().manual_seed(1234))
    assert torch.equal(torch.rand(4, generator=registered), expected)
