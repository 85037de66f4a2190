"""megatron-core's GPTModel on CPU, built from the args of a Megatron checkpoint: the patches a
CPU-only run needs (current_device → cpu, `.cuda()` a no-op, an explicit causal mask, a no-op
RNG-tracker fork) and a single-process gloo group."""
import argparse
import contextlib
import os
import warnings

import torch
import torch.nn.functional as F
from megatron.core import model_parallel_config

torch.cuda.current_device = lambda: torch.device("cpu")
# LanguageModule moves a pipeline's tied embedding copy, DDP its buffers, to the GPU.
torch.Tensor.cuda = lambda self, *a, **k: self
# megatron-core 0.15's model_parallel_config.py warns about EP × TP without SP through a
# module it never imports.
model_parallel_config.warnings = warnings


def init():
    if torch.distributed.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.moe import moe_utils
    # Without Transformer Engine megatron-core 0.15 leaves the router's GEMM name undefined
    # (moe_utils.py imports it only when TE is present) and then tests it.
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()


def load_pt(path):
    """torch.load with the default weights_only unpickler; Namespace allowed as megatron-core does
    (added, as megatron-core's safe_globals.py adds it: torch's `safe_globals` context manager
    would drop megatron-core's own list on leaving)."""
    torch.serialization.add_safe_globals([argparse.Namespace])
    return torch.load(path, weights_only=True)


def rank_stage(iteration_dir):
    """In a process of torchrun (or alone, one rank): the process group over gloo and
    megatron-core's parallel state of the layout of the torch-format checkpoint iteration directory
    `iteration_dir` (TP × PP × EP); this rank's GPTModel stage loaded strictly from its
    mp_rank_TT[_PPP][_EEE] file. Returns (file name, model, loaded object)."""
    from megatron.core import parallel_state, tensor_parallel
    if not torch.distributed.is_initialized():
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    torch.distributed.init_process_group("gloo")
    names = sorted(p.name for p in iteration_dir.glob("mp_rank_*"))
    a = load_pt(iteration_dir / names[0] / "model_optim_rng.pt")["args"]
    ep_size = getattr(a, "expert_model_parallel_size", 1) or 1
    parallel_state.initialize_model_parallel(
        a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=getattr(a, "expert_tensor_parallel_size", None))
    tensor_parallel.random.get_cuda_rng_tracker().fork = lambda *x, **k: contextlib.nullcontext()
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    ep = parallel_state.get_expert_model_parallel_rank()
    name = (f"mp_rank_{tp:02d}" + (f"_{pp:03d}" if a.pipeline_model_parallel_size > 1 else "")
            + (f"_{ep:03d}" if ep_size > 1 else ""))
    obj = load_pt(iteration_dir / name / "model_optim_rng.pt")
    model = stage_model(obj["args"])
    model.load_state_dict(obj["model"], strict=True)
    return name, model, obj


def stage_model(a):
    """This rank's pipeline stage of the GPTModel of args `a` (parallel state initialized)."""
    from megatron.core import parallel_state
    return gpt_model(a, parallel_state.is_pipeline_first_stage(),
                     parallel_state.is_pipeline_last_stage())


def moe_config(a, losses=None):
    """TransformerConfig's mixture-of-experts fields from checkpoint args (none without
    experts): megatron-core's MoELayer with SequentialMLP experts (GroupedMLP's with
    `moe_grouped_gemm`) and the all-gather dispatcher;
    `losses` sets the auxiliary losses (none by default)."""
    if getattr(a, "num_experts", None) is None:
        return {}
    fields = dict(
        num_moe_experts=a.num_experts, moe_router_topk=a.moe_router_topk,
        moe_ffn_hidden_size=a.moe_ffn_hidden_size, moe_router_pre_softmax=a.moe_router_pre_softmax,
        moe_router_score_function=a.moe_router_score_function, moe_layer_freq=a.moe_layer_freq,
        moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size,
        moe_router_topk_scaling_factor=a.moe_router_topk_scaling_factor,
        moe_router_num_groups=getattr(a, "moe_router_num_groups", None),
        moe_router_group_topk=getattr(a, "moe_router_group_topk", None),
        moe_router_enable_expert_bias=getattr(a, "moe_router_enable_expert_bias", False),
        moe_router_bias_update_rate=getattr(a, "moe_router_bias_update_rate", None) or 1e-3,
        moe_expert_capacity_factor=getattr(a, "moe_expert_capacity_factor", None),
        moe_token_drop_policy=getattr(a, "moe_token_drop_policy", None) or "probs",
        moe_pad_expert_input_to_capacity=getattr(a, "moe_pad_expert_input_to_capacity", False),
        moe_router_load_balancing_type="none", moe_token_dispatcher_type="allgather",
        moe_grouped_gemm=getattr(a, "moe_grouped_gemm", False),
        expert_model_parallel_size=getattr(a, "expert_model_parallel_size", 1),
        expert_tensor_parallel_size=getattr(a, "expert_tensor_parallel_size", None))
    if fields["moe_grouped_gemm"]:
        # GroupedMLP (the local spec's grouped experts) insists on the CUDA grouped_gemm package
        # for its GEMMs, which a layout check never runs: its parameters are built without it.
        from megatron.core.transformer.moe import grouped_gemm_util
        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    return {**fields, **(losses or {})}


def mla_config(a):
    """MLATransformerConfig's multi-latent attention fields from checkpoint args (none without
    it): the latents, head dimensions and RoPE (YaRN's under megatron-core's names)."""
    if not getattr(a, "multi_latent_attention", False):
        return {}
    fields = dict(multi_latent_attention=True, q_lora_rank=a.q_lora_rank,
                  kv_lora_rank=a.kv_lora_rank, qk_head_dim=a.qk_head_dim,
                  qk_pos_emb_head_dim=a.qk_pos_emb_head_dim, v_head_dim=a.v_head_dim,
                  rope_type=a.rope_type, rotary_base=a.rotary_base)
    if a.rope_type == "yarn":
        fields.update(rotary_scaling_factor=a.rotary_scaling_factor, mscale=a.mscale,
                      mscale_all_dim=a.mscale_all_dim, beta_fast=a.beta_fast,
                      beta_slow=a.beta_slow,
                      original_max_position_embeddings=a.original_max_position_embeddings)
    return fields


class MlaCoreAttention(torch.nn.Module):
    """Causal softmax attention as Transformer Engine's DotProductAttention computes it for
    multi-latent attention: queries and keys `[s, b, heads, dq]`, values `[s, b, heads, dv]`,
    scores scaled by MultiLatentAttention's softmax_scale; output `[s, b, heads·dv]`."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None,
                 k_channels=None, v_channels=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        scores = q @ k.transpose(-1, -2) * self.scale
        s = scores.shape[-1]
        causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
        out = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        return out.permute(2, 0, 1, 3).reshape(s, q.shape[0], -1)


def sequence_parallel_norms():
    """megatron-core's torch-norm fallback (transformer/torch_norm.py WrappedTorchNorm) refuses
    sequence parallelism, which only its Apex / TE norms take: build it without, then mark its
    parameters `sequence_parallel` as Apex's FusedLayerNorm does (fusions/fused_layer_norm.py),
    so that finalize_model_grads sums their gradients over TP — the same norm."""
    from megatron.core.transformer import torch_norm
    build = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False,
            zero_centered_gamma=False, normalization="LayerNorm"):
        sp, config.sequence_parallel = config.sequence_parallel, False
        try:
            norm = build(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                         normalization)
        finally:
            config.sequence_parallel = sp
        for p in norm.parameters():
            p.sequence_parallel = sp
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


def gpt_model(a, pre_process=True, post_process=True, vp_stage=None, moe_losses=None,
              mtp_layout="mcore"):
    """GPTModel (or, with `pre_process` / `post_process` as Megatron sets them per stage, one
    pipeline stage of it, or model chunk `vp_stage` of one) of the checkpoint args `a`, in the
    current parallel state. With `a.mtp_num_layers`, multi-token prediction as Megatron's
    gpt_builders.py builds it (get_gpt_mtp_block_spec of the decoder's last layer spec, local
    backend; `a.mtp_loss_scaling_factor`, Megatron's default 0.1); `mtp_layout="mindspeed"` gives
    MindSpeed-LLM's arrangement of it instead (MindSpeedMtpGPTModel below)."""
    init()
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_decoder_block_spec,
                                                          get_gpt_layer_local_spec,
                                                          get_gpt_mtp_block_spec)
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    mla = mla_config(a)
    config_class = TransformerConfig
    if mla:
        from megatron.core.transformer.transformer_config import MLATransformerConfig as config_class
    norm = getattr(a, "normalization", "RMSNorm")
    # --squared-relu: megatron-core's non-gated squared ReLU MLP, else SwiGLU (--swiglu)
    from megatron.core.activations import squared_relu
    squared = getattr(a, "squared_relu", False)
    cfg = config_class(
        num_layers=a.num_layers, hidden_size=a.hidden_size, num_attention_heads=a.num_attention_heads,
        num_query_groups=a.num_query_groups, kv_channels=a.kv_channels,
        ffn_hidden_size=a.ffn_hidden_size, normalization=norm, layernorm_epsilon=a.norm_epsilon,
        gated_linear_unit=not squared, activation_func=squared_relu if squared else F.silu,
        add_bias_linear=a.add_bias_linear,
        add_qkv_bias=a.add_qkv_bias, qk_layernorm=getattr(a, "qk_layernorm", False),
        bias_activation_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        params_dtype=torch.float32, pipeline_dtype=torch.float32,
        tensor_model_parallel_size=getattr(a, "tensor_model_parallel_size", 1),
        pipeline_model_parallel_size=getattr(a, "pipeline_model_parallel_size", 1),
        sequence_parallel=getattr(a, "sequence_parallel", False),
        num_layers_in_first_pipeline_stage=getattr(a, "decoder_first_pipeline_num_layers", None),
        num_layers_in_last_pipeline_stage=getattr(a, "decoder_last_pipeline_num_layers", None),
        virtual_pipeline_model_parallel_size=getattr(a, "virtual_pipeline_model_parallel_size", None),
        **mtp_config(a), **moe_config(a, moe_losses), **mla)
    if cfg.num_moe_experts:
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=norm,
                                          vp_stage=vp_stage)
    else:
        spec = get_gpt_layer_local_spec(normalization=norm,
                                        qk_layernorm=getattr(a, "qk_layernorm", False),
                                        multi_latent_attention=bool(mla))
    if mla:
        # megatron-core 0.15's local DotProductAttention takes no k_channels / v_channels: only
        # Transformer Engine's runs multi-latent attention. The plain one below stands in for it.
        for layer in getattr(spec, "layer_specs", [spec]):
            layer.submodules.self_attention.submodules.core_attention = MlaCoreAttention
    if list(getattr(a, "spec", None) or []) == MINIMAX_SPEC:
        for layer in getattr(spec, "layer_specs", [spec]):
            layer.submodules.self_attention.module = minimax_attention()
    # (after the substitutions above: the MTP layer is the decoder's last layer spec, shared)
    mtp = (get_gpt_mtp_block_spec(cfg, spec, use_transformer_engine=False, vp_stage=vp_stage)
           if cfg.mtp_num_layers else None)
    if mtp_layout not in ("mcore", "mindspeed"):
        raise ValueError(f"mtp_layout {mtp_layout!r}")
    model_class = GPTModel if mtp is None else mtp_gpt_model(mtp_layout)
    model = model_class(
        config=cfg, pre_process=pre_process, post_process=post_process, transformer_layer_spec=spec,
        vocab_size=a.padded_vocab_size, max_sequence_length=a.max_position_embeddings,
        position_embedding_type="rope", rotary_base=int(a.rotary_base),
        rotary_percent=getattr(a, "rotary_percent", 1.0),
        share_embeddings_and_output_weights=not a.untie_embeddings_and_output_weights,
        rope_scaling=a.use_rope_scaling, rope_scaling_factor=a.rope_scaling_factor or 8.0,
        mtp_block_spec=mtp, vp_stage=vp_stage)
    mindspeed_biases(model, cfg, a)
    return model


def mindspeed_biases(model, cfg, a):
    """MindSpeed-LLM's biases megatron-core lacks: `--add-dense-bias` gives every attention's
    linear_proj one, added inside it (mindspeed_llm/tasks/models/transformer/attention.py
    SelfAttentionWithDenseBias: bias=True, skip_bias_add=False), `--add-output-layer-bias` the
    output layer (mindspeed_llm/core/models/gpt/gpt_model.py: ColumnParallelLinear with
    bias=args.add_output_layer_bias, skip_bias_add=False)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    if getattr(a, "add_dense_bias", False) and not a.add_bias_linear:
        for layer in getattr(getattr(model, "decoder", None), "layers", []):
            old = layer.self_attention.linear_proj
            layer.self_attention.linear_proj = RowParallelLinear(
                old.input_size, old.output_size, config=cfg, init_method=cfg.output_layer_init_method,
                bias=True, input_is_parallel=True, skip_bias_add=False, is_expert=False)
    if getattr(a, "add_output_layer_bias", False) and getattr(model, "post_process", False):
        model.output_layer = ColumnParallelLinear(
            cfg.hidden_size, model.vocab_size, config=cfg, init_method=cfg.init_method, bias=True,
            skip_bias_add=False, gather_output=not model.parallel_output)


def mtp_config(a):
    """TransformerConfig's multi-token prediction fields from checkpoint args (none without)."""
    if not getattr(a, "mtp_num_layers", None):
        return {}
    factor = getattr(a, "mtp_loss_scaling_factor", None)
    return dict(mtp_num_layers=a.mtp_num_layers,
                mtp_loss_scaling_factor=0.1 if factor is None else factor)


def mtp_gpt_model(layout):
    """GPTModel with multi-token prediction, `layout` "mcore" or "mindspeed". Called with labels
    it is megatron-core's GPTModel as is ("mcore") or MindSpeed-LLM's arrangement ("mindspeed",
    below). Called without labels both give the main logits: megatron-core 0.15.3's
    _postprocess would fail there (`labels.clone()`), MindSpeed-LLM's mtp_block_forward too."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    if layout == "mindspeed":
        return mindspeed_mtp_gpt_model()

    class McoreMtpGPTModel(GPTModel):
        def _postprocess(self, hidden_states, input_ids, position_ids, labels, *args, **kwargs):
            if labels is not None:
                return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args,
                                            **kwargs)
            self.mtp_process = False
            try:
                kwargs["mtp_in_postprocess"] = False
                return super()._postprocess(hidden_states, input_ids, position_ids, labels, *args,
                                            **kwargs)
            finally:
                self.mtp_process = True

    return McoreMtpGPTModel


def mindspeed_mtp_gpt_model():
    """megatron-core's GPTModel with MindSpeed-LLM's multi-token prediction (its patches in
    mindspeed_llm/core/models/gpt/gpt_model.py, mindspeed_llm/core/transformer/
    multi_token_prediction.py and transformer_block.py), re-expressed over megatron-core 0.15's
    own modules — this is not MindSpeed-LLM's code, which needs torch_npu:

    - the decoder's final norm moves out of the block to the model (`final_layernorm.weight`,
      no `decoder.final_layernorm`) and is applied after the MTP block, so MTP depth 1 takes the
      decoder's un-normed output;
    - each MTP layer loses its final_layernorm to the block (`mtp.final_layernorms.{k}.weight`,
      its mtp_block_build_layers_wrapper), applied to a copy of the depth's output just before
      the output layer: depth k + 1 takes depth k's un-normed output;
    - each depth's loss is taken inside the block (mtp_block_forward) as megatron-core takes it
      in GPTModel._postprocess for pretraining data: labels and loss mask rolled left once more
      per depth (roll_tensor: the last position zero), CE · mask, logged as sum / rolled-mask
      sum, attached through MTPLossAutoScaler as mtp_loss_scaling_factor / depths · CE · mask
      (/ rolled-mask sum unless calculate_per_token_loss).

    MindSpeed-LLM keeps position_ids unrolled where megatron-core's MTP layer rolls them: with
    RoPE the embedding never reads them. Its all_gather_last_dim_from_tensor_parallel_region after
    eh_proj differs from megatron-core's gather only in its backward under TP > 1 (not
    modelled). The MTP layer itself (embedding of the rolled ids, enorm, hnorm,
    eh_proj(cat(enorm(e), hnorm(h))), the transformer layer) is megatron-core's
    MultiTokenPredictionLayer with its final norm made the identity."""
    import collections
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.multi_token_prediction import (MTPLossAutoScaler,
                                                                  MTPLossLoggingHelper, roll_tensor)

    class MindSpeedMtpGPTModel(GPTModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if not self.mtp_process:
                return
            norm, self.decoder.final_layernorm = self.decoder.final_layernorm, None
            self.mtp.final_layernorms = torch.nn.ModuleList(
                [layer.final_layernorm for layer in self.mtp.layers])
            for layer in self.mtp.layers:
                layer.final_layernorm = torch.nn.Identity()
            # MindSpeed-LLM's module order: ..., decoder, mtp, final_layernorm, output_layer
            modules = collections.OrderedDict()
            for name, module in self._modules.items():
                if name == "output_layer":
                    modules["final_layernorm"] = norm
                modules[name] = module
            modules.setdefault("final_layernorm", norm)
            self._modules = modules

        def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb,
                         rotary_pos_cos, rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None,
                         attention_mask=None, packed_seq_params=None, sequence_len_offset=None,
                         extra_block_kwargs=None, runtime_gather_output=None, **unused):
            if not self.mtp_process:
                return super()._postprocess(
                    hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos,
                    rotary_pos_sin, mtp_in_postprocess=mtp_in_postprocess, loss_mask=loss_mask,
                    attention_mask=attention_mask, packed_seq_params=packed_seq_params,
                    sequence_len_offset=sequence_len_offset, extra_block_kwargs=extra_block_kwargs,
                    runtime_gather_output=runtime_gather_output, **unused)
            weight = (self.shared_embedding_or_output_weight()
                      if self.share_embeddings_and_output_weights else None)
            main = hidden_states
            if labels is not None:
                depths = self.config.mtp_num_layers
                states = torch.chunk(self.mtp(
                    input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
                    attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                    rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                    packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                    embedding=self.embedding, **(extra_block_kwargs or {})), 1 + depths, dim=0)
                main = states[0]
                mtp_labels = labels
                mask = loss_mask if loss_mask is not None else torch.ones_like(labels)
                for k in range(depths):
                    logits, _ = self.output_layer(self.mtp.final_layernorms[k](states[k + 1]),
                                                  weight=weight,
                                                  runtime_gather_output=runtime_gather_output)
                    mtp_labels, _ = roll_tensor(mtp_labels, shifts=-1, dims=-1)
                    mask, _ = roll_tensor(mask, shifts=-1, dims=-1)
                    num_tokens = torch.sum(mask)
                    loss = mask * self.compute_language_model_loss(mtp_labels, logits)
                    if self.training:
                        MTPLossLoggingHelper.save_loss_to_tracker(torch.sum(loss) / num_tokens, k,
                                                                  depths)
                    scale = self.config.mtp_loss_scaling_factor / depths
                    main = MTPLossAutoScaler.apply(
                        main, scale * loss if self.config.calculate_per_token_loss
                        else scale * loss / num_tokens)
            logits, _ = self.output_layer(self.final_layernorm(main), weight=weight,
                                          runtime_gather_output=runtime_gather_output)
            if labels is None:
                return logits.transpose(0, 1).contiguous()
            return self.compute_language_model_loss(labels, logits)

    return MindSpeedMtpGPTModel


MINIMAX_SPEC = ["mindspeed_llm.tasks.models.spec.minimax_spec", "layer_spec"]


def minimax_attention():
    """A port of MindSpeed-LLM's MinimaxAttention (mindspeed_llm/tasks/models/transformer/
    minimax_attention.py, which needs torch_npu and megatron.training to import): megatron-core's
    SelfAttention whose q and k layernorms each normalise all of a token's heads at once, γ over
    heads · head_dim (query groups · head_dim for k), applied before RoPE."""
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.spec_utils import build_module

    class MinimaxAttention(SelfAttention):
        def __init__(self, config, submodules, layer_number, attn_mask_type, **kw):
            super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                             attn_mask_type=attn_mask_type, **kw)
            for name, n in (("q_layernorm", config.num_attention_heads),
                            ("k_layernorm", config.num_query_groups)):
                setattr(self, name, build_module(getattr(submodules, name),
                                                 hidden_size=config.kv_channels * n, config=config,
                                                 eps=config.layernorm_epsilon))

        def get_query_key_value_tensors(self, hidden_states, key_value_states=None, *a, **k):
            mixed, _ = self.linear_qkv(hidden_states)
            groups = self.num_query_groups_per_partition
            per_group = self.num_attention_heads_per_partition // groups
            d = self.hidden_size_per_attention_head
            mixed = mixed.view(*mixed.shape[:-1], groups, (per_group + 2) * d)
            q, key, value = torch.split(mixed, [per_group * d, d, d], dim=3)
            s, b = q.shape[:2]
            q = self.q_layernorm(q.reshape(s, b, 1, -1)).reshape(s, b, -1, d)
            key = self.k_layernorm(key.reshape(s, b, 1, -1)).reshape(s, b, -1, d)
            return q, key, value

    return MinimaxAttention


def logits(model, ids, vocab):
    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None].expand(b, 1, s, s)
    with torch.no_grad():
        return model(ids, pos, mask)[..., :vocab]


def mtp_logits(model, ids, vocab):
    """The main logits `[b, s, vocab]` of a GPTModel with multi-token prediction and each MTP
    depth's (position i of depth k predicting token i + k + 1 from the ids rolled left k times,
    the vacated positions id 0): the output layer's outputs of one labelled forward pass (labels
    zero; megatron-core needs them to run its MTP block), which calls it for each depth, then for
    the main head. Single tensor-parallel rank."""
    b, s = ids.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None].expand(b, 1, s, s)
    seen = []
    # (cloned: the loss that follows each call works on the logits in place)
    hook = model.output_layer.register_forward_hook(
        lambda module, args, out: seen.append(out[0].clone()))
    try:
        with torch.no_grad():
            model(ids, pos, mask, labels=torch.zeros_like(ids))
    finally:
        hook.remove()
    assert len(seen) == 1 + model.config.mtp_num_layers, len(seen)
    out = [t.transpose(0, 1)[..., :vocab] for t in seen]
    return out[-1], out[:-1]


def keep_norms_f32(model):
    """`model` in bf16 as MindSpeed-LLM's --init-norm-weight-in-fp32 leaves it (its
    dsa_indexer.py `norm2fp32_fp16module_init_wrapper`: after Float16Module made the model
    bf16, every RMSNorm and LayerNorm back to f32)."""
    model.to(torch.bfloat16)
    for m in model.modules():
        if "Norm" in type(m).__name__:
            m.float()
    return model


def ddp_of(model, bucket_size=None, disable_bucketing=False):
    """megatron-core's own DistributedDataParallel of `model` for the distributed optimizer
    (buckets of `bucket_size` unless disabled)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    return DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=bucket_size is not None,
        bucket_size=bucket_size), model, disable_bucketing=disable_bucketing)


def same_layout(buffer, model, weights, saved):
    """megatron-core's `buffer` of `model` lays out `saved` — one buffer of a distrib_optim.pt —
    as mindkit wrote it: its numel_unpadded, and each parameter's main copy (`weights`, the
    model state dict saved beside it) at the parameter's offset, bucket after bucket up to each
    bucket's last parameter. Returns the buffer's buckets."""
    assert saved["numel_unpadded"] == buffer.numel_unpadded == saved["param"].numel()
    names = {p: n for n, p in model.named_parameters()}
    before, at = 0, {}
    for b in buffer.buckets:
        at[b.bucket_id] = before - b.offset
        before += b.numel_unpadded
    for p, (start, end, bucket_id) in buffer.param_index_map.items():
        start, end = start + at[bucket_id], end + at[bucket_id]
        main = saved["param"][start:end]
        weight = weights[names[p].removeprefix("module.")].flatten()
        assert torch.equal(main.to(weight.dtype), weight), names[p]
        assert saved["exp_avg_sq"][start:end].max() > 0, names[p]  # (padded vocabulary rows get none)
    return buffer.buckets


def same_buffer(model, weights, saved, bucket_size=None, disable_bucketing=False):
    """megatron-core's one DDP buffer of `model` lays out `saved` ([`same_layout`])."""
    (buffer,) = ddp_of(model, bucket_size, disable_bucketing).buffers
    return same_layout(buffer, model, weights, saved)


def same_buffers(model, weights, entries, bucket_size=None):
    """megatron-core's DDP of `model` keys a buffer per (param dtype, grad dtype), in the order it
    meets them among the parameters: `entries` — distrib_optim.pt's buffers in order, each
    {(param dtype, grad dtype): state} — are those, each laid out as [`same_layout`] checks.
    Returns every buffer's buckets."""
    buffers = ddp_of(model, bucket_size).buffers
    assert [list(e) for e in entries] == [[(b.param_dtype, b.grad_dtype)] for b in buffers]
    return [bucket for b, e in zip(buffers, entries)
            for bucket in same_layout(b, model, weights, next(iter(e.values())))]
