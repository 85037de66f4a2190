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

    ids_ds = IndexedDataset(f"{prefix}_packed_input_ids_document")
    labels_ds = IndexedDataset(f"{prefix}_packed_labels_document")
    collate = collator(model_dir, multiple_of or seq)

    def micro_loss(model, docs):
        features = []
        for doc in docs:
            ids = ids_ds.get(doc).astype(np.int64)
            features.append({"input_ids": ids.tolist(), "attention_mask": [1] * len(ids),
                             "labels": labels_ds.get(doc).astype(np.int64).tolist()})
        batch = collate(features)
        logits = model(input_ids=batch["input_ids"]).logits.float()[:, :-1]
        labels = batch["labels"][:, 1:]
        mask = (labels != -100).float().reshape(-1)
        losses = F.cross_entropy(logits.reshape(-1, vocab_padded), labels.clamp(min=0).reshape(-1),
                                 reduction="none")
        return torch.sum(losses * mask) / mask.sum(), []

    bounds = legacy_split(split, len(ids_ds))
    order = index_mapping(bounds[0], bounds[1] - bounds[0], iters * gbs, seed, gbs, shuffle, padded)
    model = train_reference.padded_model(model_dir, vocab_padded)
    history, opt = optimise(model, order, micro_loss, mbs=mbs, gbs=gbs, iters=iters, lr=lr,
                            min_lr=min_lr, warmup_iters=warmup_iters, decay_style=decay_style,
                            weight_decay=weight_decay, clip_grad=clip_grad)
    return history, model, opt


def collator(model_dir, multiple_of):
    """MindSpeed-LLM's collator: transformers' DataCollatorForSeq2Seq, eos as the pad."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    return DataCollatorForSeq2Seq(tokenizer, pad_to_multiple_of=multiple_of, return_tensors="pt",
                                  padding=True)


def optimise(model, order, micro_loss, *, mbs, gbs, iters, lr, min_lr, warmup_iters, decay_style,
             weight_decay, clip_grad):
    """Megatron's step over `order`'s samples: each micro-batch's loss / K backward, the
    gradient clipped, AdamW and the schedule. `micro_loss(model, docs)` gives a micro-batch's
    loss and its other logged values; history holds (loss, grad norm, lr, *others) per step."""
    from megatron.core.optimizer import _get_param_groups
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

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
        means, others = [], []
        for k in range(k_micro):
            start = it * gbs + k * mbs
            loss, other = micro_loss(model, order[start:start + mbs])
            means.append(loss.item())
            others.append(other)
            (loss / k_micro).backward()
        norm = torch.norm(torch.stack([torch.norm(p.grad) for p in params])).item()
        coeff = clip_grad / (norm + 1.0e-6)
        if clip_grad > 0 and coeff < 1.0:
            for p in params:
                p.grad.mul_(coeff)
        opt.step()
        sched.step(increment=gbs)
        lr_printed = float(torch.tensor(opt.param_groups[0]["lr"], dtype=torch.float32))
        averaged = [sum(o[i] for o in others) / k_micro for i in range(len(others[0]))]
        history.append((sum(means) / len(means), norm, lr_printed, *averaged))
    return history, opt


def infer_seqlen(source_len, target_len, cutoff_len):
    """decoder_packed_mtf_dataset.py `_infer_seqlen`."""
    if target_len * 2 < cutoff_len:
        max_target_len = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target_len = cutoff_len - source_len
    else:
        max_target_len = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target_len = min(max_target_len, target_len)
    new_source_len = min(max(cutoff_len - new_target_len, 0), source_len)
    return new_source_len, new_target_len


def cut_pairwise(item, seq):
    """decoder_packed_mtf_dataset.py `_cut_pairwise_token`."""
    prompt_length = (item["chosen_labels"] != -100).nonzero()[0][0]
    prompt_ids = item["chosen_input_ids"][:prompt_length]
    chosen_ids = item["chosen_input_ids"][prompt_length:]
    rejected_ids = item["rejected_input_ids"][prompt_length:]
    source_len, target_len = infer_seqlen(len(prompt_ids), max(len(chosen_ids), len(rejected_ids)), seq)
    out = {}
    for key, answer in (("chosen", chosen_ids), ("rejected", rejected_ids)):
        ids = np.append(prompt_ids[:source_len], answer[:target_len])
        out[key] = {"input_ids": ids.astype(np.int64).tolist(), "attention_mask": [1] * len(ids),
                    "labels": np.append(-100 * np.ones(source_len), answer[:target_len]).astype(np.int64).tolist()}
    return out


def log_probs(logits, labels):
    """posttrain/utils.py `compute_log_probs` on one rank, after dpo_trainer.py's shift."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    mask = labels != -100
    labels[labels == -100] = 0
    per_token = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    return (per_token * mask).sum(-1), mask.sum(-1)


def dpo_train(model_dir, prefix, *, seq, mbs, gbs, iters, lr, min_lr, warmup_iters, decay_style,
              weight_decay, clip_grad, beta, loss_type="sigmoid", label_smoothing=0.0, ftx=0.0,
              seed=1234, vocab_padded):
    """MindSpeed-LLM's DPO (posttrain/dpo/dpo_trainer.py, dpo_model.py): the pairs' chosen rows
    then their rejected rows (PairwiseDataCollatorWithPadding), scored by the policy and by a
    frozen copy of the starting weights; the pair loss's mean per micro-batch; history rows add
    the rewards' accuracy."""
    import copy
    megatron_cpu.init()
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    files = {key: IndexedDataset(f"{prefix}_packed_{key}_document")
             for key in ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")}
    collate = collator(model_dir, seq)
    model = train_reference.padded_model(model_dir, vocab_padded)
    reference = copy.deepcopy(model).eval()

    def micro_loss(policy, docs):
        pairs = [cut_pairwise({k: f.get(d).astype(np.int64) for k, f in files.items()}, seq)
                 for d in docs]
        batch = collate([p["chosen"] for p in pairs] + [p["rejected"] for p in pairs])
        with torch.no_grad():
            ref, _ = log_probs(reference(input_ids=batch["input_ids"]).logits.float(), batch["labels"])
        pol, length = log_probs(policy(input_ids=batch["input_ids"]).logits.float(), batch["labels"])
        if loss_type == "ipo":
            pol, ref = pol / length.clamp(min=1), ref / length.clamp(min=1)
        n = len(docs)
        (pc, pr), (rc, rr) = (pol[:n], pol[n:]), (ref[:n], ref[n:])
        z = (pc - pr) - (rc - rr)
        if loss_type == "sigmoid":
            losses = (-F.logsigmoid(beta * z) * (1 - label_smoothing)
                      - F.logsigmoid(-beta * z) * label_smoothing)
        elif loss_type == "hinge":
            losses = torch.relu(1 - beta * z)
        else:
            losses = (z - 1 / (2 * beta)) ** 2
        if ftx > 1e-6:
            losses = losses + ftx * -(pc / length[:n].clamp(min=1))
        accuracy = (beta * (pc - rc).detach() > beta * (pr - rr).detach()).float().mean().item()
        return losses.mean(), [accuracy]

    bounds = legacy_split("1", len(files["chosen_input_ids"]))
    order = index_mapping(bounds[0], bounds[1] - bounds[0], iters * gbs, seed, gbs, True, False)
    history, _ = optimise(model, order, micro_loss, mbs=mbs, gbs=gbs, iters=iters, lr=lr,
                          min_lr=min_lr, warmup_iters=warmup_iters, decay_style=decay_style,
                          weight_decay=weight_decay, clip_grad=clip_grad)
    return history
