"""A PyTorch reference of MindSpeed-LLM's supervised fine-tuning, ported from its source (it
needs torch_npu and cannot run here): the sample order of `decoder_packed_mtf_dataset.py`
(`_build_index_mappings`: per-epoch numpy RandomState shuffles, --padded-samples), Megatron's
legacy split (`megatron/legacy/data/dataset_utils.py: get_train_valid_test_split_`), the real
transformers `DataCollatorForSeq2Seq` MindSpeed-LLM collates with, the label shift of its
GPTModel (`labels[:, 1:]` against `logits[:-1]`) and its SFT `loss_func` (the micro-batch's
token mean, then / K). Model, optimizer, schedule and clipping as train_reference.py."""
import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, DataCollatorForSeq2Seq

import megatron_cpu
import train_reference


def legacy_split(splits_string, size):
    splits = [float(s) for s in splits_string.split(",")] if "," in splits_string else [float(splits_string)]
    while len(splits) < 3:
        splits.append(0.0)
    splits = splits[:3]
    total = sum(splits)
    splits = [s / total for s in splits]
    index = [0]
    for s in splits:
        index.append(index[-1] + int(round(s * float(size))))
    diff = index[-1] - size
    for i in range(1, len(index)):
        index[i] -= diff
    return index


def index_mapping(start, nb, num_samples, seed, gbs, shuffle, padded):
    rng = np.random.RandomState(seed=seed)
    out = []
    while len(out) < num_samples:
        epoch = np.arange(start, start + nb, dtype=np.int64)
        if padded and nb % gbs != 0:
            epoch = np.concatenate([epoch, np.arange(0, gbs - nb % gbs, dtype=np.int64)])
        if shuffle:
            rng.shuffle(epoch)
        out.extend(epoch.tolist())
    return out


def train(model_dir, prefix, *, seq, mbs, gbs, iters, lr, min_lr, warmup_iters, decay_style,
          weight_decay, clip_grad, seed=1234, split="1", padded=False, shuffle=True,
          multiple_of=None, vocab_padded):
    megatron_cpu.init()
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.optimizer import _get_param_groups
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    ids_ds = IndexedDataset(f"{prefix}_packed_input_ids_document")
    labels_ds = IndexedDataset(f"{prefix}_packed_labels_document")
    bounds = legacy_split(split, len(ids_ds))
    order = index_mapping(bounds[0], bounds[1] - bounds[0], iters * gbs, seed, gbs, shuffle, padded)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    collate = DataCollatorForSeq2Seq(tokenizer, pad_to_multiple_of=multiple_of or seq,
                                     return_tensors="pt", padding=True)
    model = train_reference.padded_model(model_dir, vocab_padded)
    groups = _get_param_groups([model], None, None, 1.0, lr, min_lr, None, None)
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=warmup_iters * gbs,
        lr_decay_steps=iters * gbs, lr_decay_style=decay_style, start_wd=weight_decay,
        end_wd=weight_decay, wd_incr_steps=iters * gbs, wd_incr_style="constant")
    params = [p for g in groups for p in g["params"]]
    k_micro = gbs // mbs
    history = []
    for it in range(iters):
        opt.zero_grad(set_to_none=False)
        means = []
        for k in range(k_micro):
            start = it * gbs + k * mbs
            features = []
            for doc in order[start:start + mbs]:
                ids = ids_ds.get(doc).astype(np.int64)
                features.append({"input_ids": ids.tolist(), "attention_mask": [1] * len(ids),
                                 "labels": labels_ds.get(doc).astype(np.int64).tolist()})
            batch = collate(features)
            logits = model(input_ids=batch["input_ids"]).logits.float()[:, :-1]
            labels = batch["labels"][:, 1:]
            mask = (labels != -100).float().reshape(-1)
            losses = F.cross_entropy(logits.reshape(-1, vocab_padded), labels.clamp(min=0).reshape(-1),
                                     reduction="none")
            loss = torch.sum(losses * mask) / mask.sum()
            means.append(loss.item())
            (loss / k_micro).backward()
        norm = torch.norm(torch.stack([torch.norm(p.grad) for p in params])).item()
        coeff = clip_grad / (norm + 1.0e-6)
        if clip_grad > 0 and coeff < 1.0:
            for p in params:
                p.grad.mul_(coeff)
        opt.step()
        sched.step(increment=gbs)
        lr_printed = float(torch.tensor(opt.param_groups[0]["lr"], dtype=torch.float32))
        history.append((sum(means) / len(means), norm, lr_printed))
    return history, model, opt
