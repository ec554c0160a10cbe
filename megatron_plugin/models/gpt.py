"""Megatron-Core's GPTModel built from an HF config, with the two things HF parity needs."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from ..errors import MegatronPluginConfigError
from .common import HFParityMixin, use_our_output_layer
from ..layers.embedding import use_our_word_embeddings
from ..layers.context_parallel import cp_index
from ..layers.masks import add_window
from ..layers.sp_comm import gather_first_dim
from ..layers.rope import RotaryEmbedding
from .. import patches
from ..quiet import QUIET_BUILD_LOGS, QUIET_CONFIG, quiet, quiet_logs
from ..plugin import MegatronLMPlugin
from ..layers.spec import block_spec, dense_mlp_spec, moe_mlp_spec
from .family import ModelFamily
from .fields import config_fields
from .gpt2 import gelu_tanh
from .mapping import StagePlan


def padded_vocab_size(vocab: int, divisible_by: int, tp: int) -> int:
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


class MegatronGPT(HFParityMixin, GPTModel):
    """GPTModel that (1) keeps padded vocabulary rows out of the softmax (`cross_entropy.py`), so the
    loss equals HF's, (2) can stop at the final norm, for HF base models (`GPT2Model`) that have no
    LM head, and (3) takes rotary positions per token from `position_ids` and an attention window, as
    the Llama family needs."""

    def __init__(self, *args, true_vocab_size: int, lm_head: bool = True, rotary: Optional[RotaryEmbedding] = None,
                 sliding_window: Optional[int] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.true_vocab_size = true_vocab_size
        self.lm_head = lm_head
        self.rotary = rotary
        self.sliding_window = sliding_window
        self.last_position_logits = False  # generation needs the next-token logits only
        if self.post_process:
            use_our_output_layer(self.output_layer)
        use_our_word_embeddings(self, self.share_embeddings_and_output_weights and self.post_process and lm_head)

    def forward(self, input_ids, position_ids, attention_mask, *args, **kwargs):
        if self.config.context_parallel_size > 1:
            attention_mask = self._window_over_context_parallel(attention_mask, position_ids)
        else:
            attention_mask = add_window(attention_mask, position_ids.shape[1], self.sliding_window, position_ids.device)
        return super().forward(input_ids, position_ids, attention_mask, *args, **kwargs)

    def _window_over_context_parallel(self, attention_mask, position_ids):
        # this rank's queries sit at global positions (chunks r and 2*CP-1-r) over the whole sequence's keys
        if self.sliding_window is None:
            return attention_mask
        cp = self.config.context_parallel_size
        seq_len = position_ids.shape[1] * cp
        queries = cp_index(seq_len, cp, self.pg_collection.cp.rank(), position_ids.device)
        return add_window(attention_mask, seq_len, self.sliding_window, position_ids.device, queries=queries)

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):
        out = super()._preprocess(input_ids, position_ids, *args, **kwargs)
        if self.rotary is None:
            return out
        return (out[0], self.rotary(position_ids), *out[2:])

    def _postprocess(self, hidden_states, **kwargs):
        if self.post_process and self.last_position_logits:
            hidden_states = hidden_states[-1:]
        if self.post_process and not self.lm_head:
            if self.config.sequence_parallel:
                # every TP rank returns the whole sequence; the caller's loss on it is the same on every rank,
                # so each keeps its own rows of the gradient (mcore's tensor_parallel_output_grad=False)
                hidden_states = gather_first_dim(hidden_states, self.pg_collection.tp, tensor_parallel_output_grad=False)
            return hidden_states.transpose(0, 1).contiguous()
        return super()._postprocess(hidden_states, **kwargs)


# other_megatron_args keys that are not TransformerConfig fields but that we know what to do with
NON_CONFIG_ARGS = {"vocab_file", "merge_file", "tokenizer_path"}
# TransformerConfig fields that the engine reads (engine/full_graph.py) and that stay out of the config: there
# cuda_graph_impl='local' would have megatron-core build its per-layer graph managers, which set a new CUDA stream
# for the whole process while the model is built
ENGINE_ARGS = {"cuda_graph_impl", "cuda_graph_scope", "cuda_graph_warmup_steps"}


def transformer_config_overrides(other_megatron_args: dict, architecture: Optional[dict] = None) -> dict:
    """The TransformerConfig fields of `other_megatron_args`. The architecture comes from the HF config
    (`architecture`): a value that contradicts it would build a model the weights don't fit."""
    if not isinstance(other_megatron_args, dict):
        raise MegatronPluginConfigError("other_megatron_args", other_megatron_args, "pass a dict of TransformerConfig fields")
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = set(other_megatron_args) - known - NON_CONFIG_ARGS
    if unknown:
        raise MegatronPluginConfigError(
            "other_megatron_args", sorted(unknown),
            "keys must be megatron.core TransformerConfig fields (e.g. 'attention_dropout') or one of "
            f"{sorted(NON_CONFIG_ARGS)}",
        )
    for key, value in other_megatron_args.items():
        if architecture and key in architecture and key not in TUNABLE and value != architecture[key]:
            raise MegatronPluginConfigError(
                f"other_megatron_args[{key!r}]", value,
                f"the HF model's config gives {architecture[key]!r}, and the model is built from it to carry its "
                "weights: remove the key, or change the HF config",
            )
    return {k: v for k, v in other_megatron_args.items() if k in known and k not in ENGINE_ARGS}


# architecture fields a user may change without changing the weights' shapes
TUNABLE = {"hidden_dropout", "attention_dropout", "init_method_std", "layernorm_epsilon",
           # MoE: the losses added to the LM loss, and token dropping (capacity), change no shape
           "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_token_drop_policy",
           "moe_pad_expert_input_to_capacity"}


def build_transformer_config(
    family: ModelFamily,
    hf_config,
    plugin: MegatronLMPlugin,
    *,
    params_dtype: torch.dtype = torch.float32,
    device_type: str = "cpu",
    overrides: Optional[dict] = None,
) -> TransformerConfig:
    architecture = family.transformer_config(hf_config)
    fields = dict(architecture)
    on_gpu = device_type == "cuda"
    wgrad_fusion = on_gpu and bool(plugin.gradient_accumulation_fusion)  # prepare resolves None
    patches.require(f"{family.name} model", *(["rope_tables"] if family.rotary else []),
                    *(["wgrad_fusion"] if wgrad_fusion else []))
    fields.update(
        tensor_model_parallel_size=plugin.tp_degree,
        pipeline_model_parallel_size=plugin.pp_degree,
        context_parallel_size=plugin.context_parallel_size or 1,
        sequence_parallel=plugin.sequence_parallelism,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # Weights come from the HF checkpoint: allocate, don't initialize.
        use_cpu_initialization=not on_gpu,
        perform_initialization=False,
        # Fusions that need CUDA / apex kernels stay off; TE's own are chosen through the spec.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=wgrad_fusion,
        persist_layer_norm=False,
        bias_dropout_fusion=on_gpu,
        recompute_granularity=plugin.recompute_granularity,
        pipeline_dtype=params_dtype,
        virtual_pipeline_model_parallel_size=plugin.virtual_pipeline_stages(fields["num_layers"]),
    )
    if fields.get("num_moe_experts"):
        fields.update(expert_model_parallel_size=plugin.expert_model_parallel_size,
                      # None: megatron-core's default, the tensor-parallel size
                      expert_tensor_parallel_size=plugin.expert_tensor_parallel_size)
    if on_gpu and plugin.fused_kernels:
        if fields["activation_func"] is gelu_tanh and fields["add_bias_linear"]:
            # mcore's fused bias-GELU computes the tanh approximation, which is what gelu_tanh is;
            # it is chosen when activation_func is F.gelu
            fields.update(activation_func=F.gelu, bias_activation_fusion=True)
    if plugin.recompute_granularity == "full":
        fields.update(recompute_method=plugin.recompute_method, recompute_num_layers=plugin.recompute_num_layers)
    fields.update(transformer_config_overrides(plugin.other_megatron_args, architecture))
    # after other_megatron_args: the plugin's model settings, merged with those keys (check_model_fields)
    fields.update(config_fields(plugin))
    fields.update(overrides or {})
    with quiet(QUIET_CONFIG):
        return TransformerConfig(**fields)


def mlp_specs(config: TransformerConfig, plan: StagePlan):
    """The MLP spec of each of the stage's layers: None (the dense MLP) for a dense model, else per layer
    the MoE layer or the dense MLP, as `moe_layer_freq` (one 0/1 per global layer) says."""
    if not config.num_moe_experts:
        return None
    pattern = config.moe_layer_freq
    if isinstance(pattern, int):
        pattern = [int(i % pattern == 0) for i in range(config.num_layers)]
    moe = moe_mlp_spec(config)
    return [moe if pattern[plan.layer_offset + j] else dense_mlp_spec() for j in range(plan.num_layers)]


def build_model(
    family: ModelFamily,
    hf_config,
    config: TransformerConfig,
    plugin: MegatronLMPlugin,
    plan: StagePlan,
    *,
    variant: str = "lm",
    backend: str = "local",
    vp_stage: Optional[int] = None,
) -> MegatronGPT:
    lm_head = variant == "lm"
    tied = family.tied_embeddings(hf_config) or not lm_head
    device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
    with quiet_logs(QUIET_BUILD_LOGS):
        return _megatron_gpt(family, hf_config, config, plugin, plan, lm_head, tied, backend, vp_stage, device)


def _megatron_gpt(family, hf_config, config, plugin, plan, lm_head, tied, backend, vp_stage, device) -> MegatronGPT:
    return MegatronGPT(
        config=config,
        transformer_layer_spec=block_spec(config, plan.num_layers, backend, mlp=mlp_specs(config, plan)),
        vocab_size=padded_vocab_size(hf_config.vocab_size, plugin.make_vocab_size_divisible_by, plugin.tp_degree),
        max_sequence_length=family.max_positions(hf_config),
        pre_process=plan.first,
        post_process=plan.last,
        share_embeddings_and_output_weights=tied,
        true_vocab_size=hf_config.vocab_size,
        lm_head=lm_head,
        vp_stage=vp_stage,
        rotary=RotaryEmbedding(hf_config, device) if family.rotary else None,
        sliding_window=family.sliding_window(hf_config),
        **family.model_kwargs(hf_config),
    )
