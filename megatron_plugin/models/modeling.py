"""`MegatronModel`: an HF model's Megatron-Core twin on this rank, with HF-style inputs and outputs."""

from __future__ import annotations

from typing import Dict, Optional

import torch
from megatron.core import parallel_state

from megatron.core.transformer.transformer_config import TransformerConfig

from ..errors import MegatronPluginConfigError
from ..layers.comm import gather_tensor_parallel_last_dim
from .common import HFParityMixin
from .convert import gather_hf_state_dict, load_hf_into_mcore, mcore_to_hf_sources, model_dims, normalize_hf_state_dict
from ..layout import current_layout
from . import get_family
from .causal import causal_lm_inputs
from .gpt import build_model, build_transformer_config
from .mapping import StagePlan, TensorSlice, expand
from ..plugin import MegatronLMPlugin
from ..layers.spec import default_backend
from ..layers.moe import padding_mask_from_hf
from ..layers.embedding import set_padding_idx
from .moe_names import checkpoint_state_dict


def expert_plan(family, hf_config, plan: StagePlan) -> StagePlan:
    """`plan` with this expert-parallel rank's experts, for an MoE family (megatron-core's expert groups)."""
    return family.plan_with_experts(hf_config, plan, parallel_state.get_expert_model_parallel_world_size(),
                                    parallel_state.get_expert_model_parallel_rank())


def experts_laid_apart(plan: StagePlan) -> bool:
    """Whether this MoE model's experts are grouped otherwise than its dense layers: split over
    expert-parallel ranks, or over an expert tensor-parallel size other than tp_degree. Their expert-data-
    parallel group then differs from the data-parallel one (megatron-core's expert RankGenerator)."""
    if not plan.num_experts:
        return False
    return plan.ep_size > 1 or (parallel_state.get_expert_tensor_parallel_world_size()
                                != parallel_state.get_tensor_model_parallel_world_size())


def hf_state_dict_of(hf_model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """A live HF model's state dict under the names the mapping tables use (its checkpoints'): an MoE
    model's stacked experts apart (models/moe_names.py)."""
    if get_family(hf_model.config).num_experts(hf_model.config):
        return checkpoint_state_dict(hf_model)
    return hf_model.state_dict()


class MegatronModel(torch.nn.Module):
    """Holds the Megatron-Core module of this rank and knows how it maps to the HF model."""

    def __init__(self, hf_config, plugin: MegatronLMPlugin, *, variant: str = "lm",
                 params_dtype: torch.dtype = torch.float32, backend: Optional[str] = None,
                 config=None, vp_stage: Optional[int] = None, module: Optional[torch.nn.Module] = None):
        """`module`: a Megatron-Core module built elsewhere (the plugin's custom_model_provider_function) to
        hold instead of building one from the HF config; its own TransformerConfig is the chunk's."""
        super().__init__()
        layout = current_layout()
        self.hf_config, self.plugin, self.variant = hf_config, plugin, variant
        self.family = get_family(hf_config)
        # model chunks of one rank (virtual pipeline stages) share one config: mcore's schedules read
        # their hooks from the first chunk's
        self.config = config or (module.config if module is not None else build_transformer_config(
            self.family, hf_config, plugin, params_dtype=params_dtype, device_type=layout.device.type
        ))
        if module is None:
            num_layers, vp_size = self.config.num_layers, self.config.virtual_pipeline_model_parallel_size or 1
        else:  # the stages' layers as prepare lays them out (the provider's config is the user's)
            num_layers = self.family.num_layers(hf_config)
            vp_size = plugin.virtual_pipeline_stages(num_layers) or 1
        self.plan = expert_plan(self.family, hf_config, StagePlan.for_rank(
            num_layers, layout.pp_size, layout.pp_rank, vp_stage or 0, vp_size,
            last_stage_layers=plugin.decoder_last_pipeline_num_layers))
        self.dims = model_dims(self.family, hf_config, plugin.make_vocab_size_divisible_by, layout.tp_size)
        self.backend = default_backend(layout.device.type, backend)
        self.provided = module is not None
        if module is None:
            build = self.family.build or build_model
            module = build(self.family, hf_config, self.config, plugin, self.plan, variant=variant,
                           backend=self.backend, vp_stage=vp_stage)
        self.module = module
        # a provider's module of our own kind maps to HF names like a built one; another does not (maps_to_hf)
        self.maps_to_hf = not self.provided or self._same_as_built()
        if self.maps_to_hf:
            self._mark_tensor_parallel_params()
        if layout.device.type == "cuda":
            self.module.cuda(layout.device)

    def _same_as_built(self) -> bool:
        """Whether a provided module is what we would have built for this HF config: our model class (the
        mapping tables are written for its parameters), the table's parameter names, and the config's
        architecture (shapes) and padded vocabulary."""
        if not isinstance(self.module, HFParityMixin):
            return False
        names = {n for n, _ in self.module.named_parameters()}
        if names != set(mcore_to_hf_sources(self.family, self.hf_config, self.plan, self.variant)):
            return False
        mine = self.family.transformer_config(self.hf_config)
        keys = ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels")
        if any(getattr(self.config, k, None) != mine[k] for k in keys if mine.get(k) is not None):
            return False
        return getattr(self.module, "vocab_size", self.dims.padded_vocab) == self.dims.padded_vocab

    def check_maps_to_hf(self, what: str) -> None:
        """Refuse `what` (an HF export) for a provider's module the mapping tables do not describe."""
        if not self.maps_to_hf:
            provider = self.plugin.custom_model_provider_function
            raise MegatronPluginConfigError(
                "custom_model_provider_function", getattr(provider, "__qualname__", provider),
                f"{what} writes HF-named weights through {self.family.name}'s mapping table, which describes the model "
                f"prepare builds; this provider returned a {type(self.module).__name__} it does not describe: save "
                "with accelerator.save_state, or have the provider return the family's module "
                "(megatron_plugin.models.modeling.MegatronModel(hf_config, plugin).module, then load its weights)",
            )

    def _mark_tensor_parallel_params(self):
        """mcore sets `tensor_model_parallel` / `partition_dim` only when it initializes weights, which we
        skip (HF weights are loaded instead). Grad-norm and optimizer code rely on them: set them from
        the mapping table, which knows which tensors are split and along which dimension."""
        params = dict(self.module.named_parameters())
        rules = self.family.table(self.hf_config, self.variant)
        experts_apart = experts_laid_apart(self.plan)
        for rule, _, name in expand(rules, self.plan):
            if name in params:
                params[name].tensor_model_parallel = rule.tp_dim is not None
                params[name].partition_dim = rule.tp_dim if rule.tp_dim is not None else -1
                params[name].partition_stride = 1
                if rule.per_expert and experts_apart:
                    # megatron-core's convention: experts laid out apart from the dense layers (split over
                    # expert-parallel ranks, or over another tensor-parallel size) are reduced over the
                    # expert-data-parallel group, not the data-parallel one
                    params[name].allreduce = False

    @property
    def lm_head(self) -> bool:
        """Whether this model predicts tokens (any variant but the base model)."""
        return self.variant != "base"

    @classmethod
    def from_hf(cls, hf_model: torch.nn.Module, plugin: MegatronLMPlugin, **kwargs) -> "MegatronModel":
        variant = get_family(hf_model.config).variant_of(hf_model)
        model = cls(hf_model.config, plugin, variant=variant, **kwargs)
        model.load_hf_state_dict(hf_state_dict_of(hf_model))
        model.take_padding_idx(hf_model)
        return model

    def take_padding_idx(self, hf_model: torch.nn.Module) -> None:
        """The HF model's embedding `padding_idx` (Llama-family, BERT; None for GPT-2, T5), whose row the
        lookup does not train: on the word embedding, when this chunk holds it (layers/embedding.py). Not
        in the config (pad_token_id is not always the embedding's), so read from the module; on the meta
        device too."""
        set_padding_idx(self.module, getattr(hf_model.get_input_embeddings(), "padding_idx", None))

    @classmethod
    def chunks_from_provider(cls, hf_model: torch.nn.Module, plugin: MegatronLMPlugin, backend: Optional[str] = None) -> list:
        """This rank's model chunks built by Megatron-LM's hooks instead of from the HF weights, as
        Megatron-LM's get_model calls them: `custom_model_provider_function(pre_process=..., post_process=...)`
        (and `vp_stage=` with virtual pipeline stages) returns one Megatron-Core module per chunk; with
        `custom_prepare_model_function(provider)` that function returns the chunks. Their weights are the
        provider's (random at first; load a checkpoint with accelerator.load_state, or in the provider). The HF
        model still gives the family (train step, inputs), the vocabulary and the layers each stage holds."""
        layout = current_layout()
        family = get_family(hf_model.config)
        num_layers = family.num_layers(hf_model.config)
        vp = plugin.virtual_pipeline_stages(num_layers)
        plans = [StagePlan.for_rank(num_layers, layout.pp_size, layout.pp_rank, i, vp or 1,
                                    last_stage_layers=plugin.decoder_last_pipeline_num_layers) for i in range(vp or 1)]
        provider, prepare = plugin.custom_model_provider_function, plugin.custom_prepare_model_function
        if prepare is not None:
            modules = prepare(provider)
            setting = "custom_prepare_model_function"
        else:
            modules = [provider(pre_process=plan.first, post_process=plan.last, **({"vp_stage": i} if vp else {}))
                       for i, plan in enumerate(plans)]
            setting = "custom_model_provider_function"
        modules = list(modules) if isinstance(modules, (list, tuple)) else [modules]
        if len(modules) != len(plans):
            raise MegatronPluginConfigError(
                setting, f"{len(modules)} model chunks",
                f"return {len(plans)}: one per virtual pipeline stage of this rank (num_layers_per_virtual_pipeline_stage)",
            )
        for m in modules:
            if not isinstance(m, torch.nn.Module) or not isinstance(getattr(m, "config", None), TransformerConfig):
                raise MegatronPluginConfigError(
                    setting, type(m).__name__,
                    "return Megatron-Core modules (e.g. a GPTModel), each with its TransformerConfig as .config",
                )
        variant = family.variant_of(hf_model)
        return [cls(hf_model.config, plugin, variant=variant, vp_stage=i if vp else None, backend=backend, module=m)
                for i, m in enumerate(modules)]

    @classmethod
    def chunks_from_hf(cls, hf_model: torch.nn.Module, plugin: MegatronLMPlugin, params_dtype=torch.float32,
                       backend: Optional[str] = None, reader=None,
                       state: Optional[Dict[str, torch.Tensor]] = None) -> list:
        """This rank's model chunks (one per virtual pipeline stage), carrying the HF weights: the model's
        own, or `state` (plain HF names: a PeftModel's base weights, whose live names peft has changed), or,
        with `reader` (an HFReader, for a model without weights), read from its files, each rank its own
        slices."""
        layout = current_layout()
        family = get_family(hf_model.config)
        config = build_transformer_config(family, hf_model.config, plugin, params_dtype=params_dtype,
                                          device_type=layout.device.type)
        vp = config.virtual_pipeline_model_parallel_size
        if reader is None and state is None:
            state = hf_state_dict_of(hf_model)
        variant = family.variant_of(hf_model)
        chunks = []
        for vp_stage in range(vp or 1):
            chunk = cls(hf_model.config, plugin, variant=variant, config=config,
                        vp_stage=vp_stage if vp else None, backend=backend)
            if reader is None:
                chunk.load_hf_state_dict(state)
            else:
                chunk.load_hf(reader.get_slice, reader.names, extra_tensors="warn")
            chunk.take_padding_idx(hf_model)
            chunks.append(chunk)
        return chunks

    def load_hf_state_dict(self, hf_state: Dict[str, torch.Tensor]) -> None:
        hf_state = normalize_hf_state_dict(hf_state, self.family, self.variant)
        self.load_hf(lambda name: TensorSlice(hf_state[name]), hf_state.keys())

    def load_hf(self, get_slice, hf_names, extra_tensors: str = "raise") -> None:
        """Fill this stage's weights from HF tensors read through `get_slice(name)` (lazily read views,
        e.g. `HFReader.get_slice`: each rank reads only its part of the files)."""
        load_hf_into_mcore(
            self.module, get_slice, hf_names, self.family, self.hf_config, self.plan, self.dims,
            extra_tensors=extra_tensors, variant=self.variant, tp_size=parallel_state.get_tensor_model_parallel_world_size(),
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            etp_size=parallel_state.get_expert_tensor_parallel_world_size(),
            etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        )

    def hf_state_dict(self, grads: bool = False) -> Dict[str, torch.Tensor]:
        """This pipeline stage's weights (or their gradients) as full HF tensors, named as in the HF
        model we came from (an MoE model's as its checkpoints name them, one tensor per expert, every
        expert: `moe_names.live_state_dict` stacks them as a live model holds them). Collective over the TP
        group, and over the expert-parallel group when experts are split."""
        self.check_maps_to_hf("hf_state_dict")
        out = gather_hf_state_dict(
            self.module, self.family, self.hf_config, self.plan, self.dims, variant=self.variant, grads=grads
        )
        strip = len(self.family.prefix(self.variant))
        return {k[strip:]: v for k, v in out.items()} if strip else out

    def forward(self, *args, **kwargs):
        """One stage's forward with HF inputs (see the family's forward)."""
        if self.family.forward is not None:
            return self.family.forward(self, *args, **kwargs)
        return self.causal_lm_forward(*args, **kwargs)

    def causal_lm_forward(self, input_ids, attention_mask=None, position_ids=None, labels=None):
        """One stage's forward with HF inputs ([b, s] ids and padding mask). With labels (already
        shifted, -100 = ignore) returns per-token losses [b, s]; else logits gathered over TP and cut to
        the true vocabulary (or hidden states for a base model)."""
        inputs = causal_lm_inputs(input_ids, attention_mask, position_ids)
        # MoE layers route padded tokens (as HF does) but leave them out of their load statistics
        mask = None if attention_mask is None else attention_mask[:, -input_ids.shape[1]:]
        extra = {"padding_mask": padding_mask_from_hf(mask)} if self.family.num_experts(self.hf_config) else {}
        if labels is not None:
            safe = labels.masked_fill(labels < 0, 0)
            return self.module(*inputs, labels=safe, **extra)
        out = self.module(*inputs, **extra)
        if self.plan.last and self.lm_head:
            out = gather_tensor_parallel_last_dim(out)[..., : self.hf_config.vocab_size]
        return out
