"""The PyTorch reference `mindkit train` is checked against: a transformers model in fp32 trained
on megatron-core 0.15.3's own GPTDataset samples (MegatronPretrainingSampler order), with
megatron-core's parameter-group rule (_get_param_groups), torch.optim.AdamW (Megatron's optimizer
when neither Transformer Engine nor apex is installed), megatron-core's OptimizerParamScheduler
stepped by the global batch size, Megatron's loss averaging (pretrain_gpt.py loss_func +
schedules.forward_step_calc_loss; --calculate-per-token-loss: finalize_model_grads) and its
gradient norm and clip coefficient (clip_grads.py; the norm of per-tensor norms, as its
fallback without apex/TE computes it)."""
import math

import torch
import torch.nn.functional as F

import megatron_cpu


class Tokenizer:
    """What GPTDataset reads of a tokenizer (HuggingFaceTokenizer: no pad id)."""

    def __init__(self, eod, pad=None):
        self.eod = eod
        self.pad = pad
        self.unique_identifiers = {"class": "MindkitReferenceTokenizer"}


def padded_model(model_dir, vocab_padded):
    """The HF model with its vocabulary rows padded as Megatron's converters (and mindkit's
    --load) pad them: copies of the last real row."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32,
                                                 attn_implementation="eager")
    tied = model.config.tie_word_embeddings
    with torch.no_grad():
        def pad(w):
            extra = w[-1:].expand(vocab_padded - w.shape[0], -1)
            return torch.nn.Parameter(torch.cat([w, extra]).clone())
        model.model.embed_tokens.weight = pad(model.model.embed_tokens.weight)
        if tied:
            model.lm_head.weight = model.model.embed_tokens.weight
        else:
            model.lm_head.weight = pad(model.lm_head.weight)
    model.config.vocab_size = vocab_padded
    return model


class Mcore(torch.nn.Module):
    """megatron-core's GPTModel called as a transformers model is (`model(input_ids=…).logits`),
    causal mask and positions made as megatron_cpu.logits makes them. With `labels` (and
    `loss_mask`, both [b, s]) it is called as pretrain_gpt.py's forward_step calls it and gives
    its per-token loss `[b, s]` as `.loss` (multi-token prediction's losses attached to the
    graph inside the model)."""

    def __init__(self, gpt):
        super().__init__()
        self.module = gpt

    def forward(self, input_ids, labels=None, loss_mask=None):
        from types import SimpleNamespace
        b, s = input_ids.shape
        pos = torch.arange(s).unsqueeze(0).expand(b, -1)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None].expand(b, 1, s, s)
        if labels is not None:
            return SimpleNamespace(loss=self.module(input_ids, pos, mask, labels=labels,
                                                    loss_mask=loss_mask))
        return SimpleNamespace(logits=self.module(input_ids, pos, mask))


def mtp_depths(model):
    """The number of multi-token prediction depths of `model` (an Mcore-wrapped GPTModel), 0
    without."""
    gpt = getattr(model, "module", None)
    return (gpt.config.mtp_num_layers or 0) if getattr(gpt, "mtp_process", False) else 0


def mtp_step_losses(micro_batches, depths):
    """The step's MTP losses as training_log logs them (MTPLossLoggingHelper.track_mtp_metrics
    with loss_scale 1 / micro-batches, one rank: each depth's tracked sum over the micro-batches
    of sum(CE · rolled mask) / rolled-mask sum, times 1 / micro-batches), the tracker cleared."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
    values = MTPLossLoggingHelper.tracker["values"] * (1 / micro_batches)
    out = {f"mtp_{k + 1} loss": values[k].item() for k in range(depths)}
    MTPLossLoggingHelper.clean_loss_in_tracker()
    return out


def moe_step_losses(micro_batches, moe_layers):
    """The step's MoE auxiliary losses as training_log logs them (track_moe_metrics on one
    rank: each layer's tracked sum over the micro-batches, / micro-batches, summed over the
    layers / MoE layers), the tracker cleared."""
    from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                         get_moe_layer_wise_logging_tracker)
    out = {name: (v["values"].float() / micro_batches).sum().item() / moe_layers
           for name, v in get_moe_layer_wise_logging_tracker().items()}
    clear_aux_losses_tracker()
    return out


def train(model_dir, prefix, *, vocab_padded, eod, seq, mbs, gbs, iters, lr, min_lr, warmup_iters,
          decay_style, weight_decay, clip_grad, betas=(0.9, 0.999), eps=1e-8, seed=1234,
          split="1", per_token=False, eod_mask_loss=False, o2_optimizer=False, model=None,
          evaluation=None, moe_layers=None, expert_bias=False):
    """Train (`model`, or the padded model of `model_dir`; only parameters that require
    gradients are trained) and return per-iteration (loss, grad norm, printed lr), the model
    and the optimizer (each iteration also gives the parameters' L2 norm after the update and
    the number of zero gradient elements). With `evaluation` = (interval, eval_iters), also the validation losses
    Megatron's evaluate() reports every interval and after the last iteration, as
    `model.validation`. With `moe_layers` (a megatron-core MoE model), each iteration's
    auxiliary losses as Megatron logs them, as `model.moe_losses` (`moe_layers` counts the MTP
    layers too where the logging does: megatron-core 0.15's training_log); with `expert_bias` too, its
    routers' expert biases move after each step's micro-batches as megatron-core's
    finalize_model_grads moves them. With `o2_optimizer`, the moments are stored rounded to bf16 after
    every step, as MindSpeed-LLM's O2AdamW (mindspeed_llm/tasks/models/common/adamw.py) keeps
    them: the step itself reads them widened to f32 and updates with the unrounded ones.
    With multi-token prediction (an Mcore-wrapped GPTModel built with it), the model is called
    with labels and loss mask as pretrain_gpt.py's forward_step calls it: its per-token loss
    gives the lm loss as before, the MTP losses enter the backward pass through
    MTPLossAutoScaler, whose scale is set as schedules.forward_step_calc_loss sets it (1 /
    micro-batches, 1 with per-token loss), and each iteration's logged `mtp_{k} loss` are
    `model.mtp_losses`."""
    megatron_cpu.init()
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list
    from megatron.core.optimizer import _get_param_groups
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    torch.manual_seed(0)
    model = model if model is not None else padded_model(model_dir, vocab_padded)
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq, blend=get_blend_from_list([prefix]), split=split,
        path_to_cache=None, reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=eod_mask_loss, tokenizer=Tokenizer(eod))
    n_valid = (iters // evaluation[0] + 1) * evaluation[1] * gbs if evaluation else None
    dataset, valid, _ = BlendedMegatronDatasetBuilder(
        GPTDataset, [iters * gbs, n_valid, None], lambda: True, config).build()
    groups = _get_param_groups([model], None, None, 1.0, lr, min_lr, None, None)
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup_iters * gbs,
        lr_decay_steps=iters * gbs, lr_decay_style=decay_style, start_wd=weight_decay,
        end_wd=weight_decay, wd_incr_steps=iters * gbs, wd_incr_style="constant")
    params = [p for g in groups for p in g["params"]]
    k_micro = gbs // mbs
    history = []
    model.validation = []
    model.moe_losses = []
    model.mtp_losses = []
    depths = mtp_depths(model)
    if depths:
        from megatron.core.transformer.multi_token_prediction import (MTPLossAutoScaler,
                                                                      MTPLossLoggingHelper)
        # the tracker is sized by the first model that tracked in this process
        MTPLossLoggingHelper.tracker.clear()
        # schedules.forward_step_calc_loss: loss_scale (ones(1) without a grad scaler) / micro-batches
        MTPLossAutoScaler.set_loss_scale(torch.ones(1) if per_token else torch.ones(1) / (gbs // mbs))
    if moe_layers:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
        from megatron.core.transformer.moe.router import MoEAuxLossAutoScaler
        # the tracker keeps the names an earlier model in this process tracked
        get_moe_layer_wise_logging_tracker().clear()
        # schedules.forward_step_calc_loss: the auxiliary losses' backward scale.
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 if per_token else 1.0 / (gbs // mbs)))

    def micro_batch(ds, start):
        batch = [ds[i] for i in range(start, start + mbs)]
        tokens = torch.stack([b["tokens"] for b in batch])
        labels = torch.stack([b["labels"] for b in batch])
        mask = torch.stack([b["loss_mask"] for b in batch]).float()
        if depths:
            # pretrain_gpt.py forward_step / loss_func: the model's per-token loss, masked
            losses = model(input_ids=tokens, labels=labels, loss_mask=mask).loss.float().view(-1)
        else:
            logits = model(input_ids=tokens).logits.float()
            losses = F.cross_entropy(logits.view(-1, vocab_padded), labels.view(-1),
                                     reduction="none")
        mask = mask.view(-1)
        return torch.sum(losses * mask), mask.sum()

    def evaluate(consumed):
        # evaluate(): the loss sums and token counts of every micro-batch of eval_iters global
        # batches, divided once.
        s_all, n_all = 0.0, 0.0
        if depths:
            model.eval()  # (as evaluate() does: no MTP loss tracked)
        with torch.no_grad():
            for start in range(consumed, consumed + evaluation[1] * gbs, mbs):
                s, n = micro_batch(valid, start)
                s_all, n_all = s_all + s.item(), n_all + n.item()
        if depths:
            model.train()
        model.validation.append(s_all / n_all)
        return consumed + evaluation[1] * gbs

    consumed_valid = 0
    for it in range(iters):
        opt.zero_grad(set_to_none=False)
        s_total = torch.zeros((), dtype=torch.float32)
        n_total = torch.zeros((), dtype=torch.float32)
        for k in range(k_micro):
            s, n = micro_batch(dataset, it * gbs + k * mbs)
            s_total += s.detach()
            n_total += n
            if per_token:
                s.backward()
            else:
                (s / torch.clamp(n, min=1) / k_micro).backward()
        if expert_bias:
            from megatron.core.distributed.finalize_model_grads import (
                _update_router_expert_bias, reset_model_temporary_tensors)
            _update_router_expert_bias([model.module], model.module.config)
            reset_model_temporary_tensors(model.module.config, [model.module])
        if per_token:
            for p in params:
                p.grad *= 1.0 / n_total
        norm = torch.norm(torch.stack([torch.norm(p.grad) for p in params])).item()
        coeff = clip_grad / (norm + 1.0e-6)
        if clip_grad > 0 and coeff < 1.0:
            for p in params:
                p.grad.mul_(coeff)
        opt.step()
        if o2_optimizer:
            for state in opt.state.values():
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key].copy_(state[key].bfloat16().float())
        sched.step(increment=gbs)
        if moe_layers:
            model.moe_losses.append(moe_step_losses(k_micro, moe_layers))
        if depths:
            model.mtp_losses.append(mtp_step_losses(k_micro, depths))
        lr_printed = float(torch.tensor(opt.param_groups[0]["lr"], dtype=torch.float32))
        zeros = sum(int((p.grad == 0).sum()) for p in params)
        params_norm = torch.norm(torch.stack([p.detach().norm() for p in params])).item()
        history.append(((s_total / n_total).item(), norm, lr_printed, params_norm, zeros))
        if evaluation and (it + 1) % evaluation[0] == 0:
            consumed_valid = evaluate(consumed_valid)
    if evaluation:
        evaluate(consumed_valid)
    return history, model, opt
