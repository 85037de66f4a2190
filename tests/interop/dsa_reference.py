"""DeepSeek sparse attention on megatron-core's GPTModel, as MindSpeed-LLM trains it
(mindspeed_llm/tasks/models/transformer/dsa_indexer.py `DSAIndexer`, `compute_dsa_indexer_loss`,
`DSAIndexerLossAutoScaler`; its multi_latent_attention.py `mla_naive_attention`), written out in
torch for the reference runs of the interop tests: each layer with an indexer of its own scores
the keys from its detached inputs (the hidden state, and the query latent before its norm as the
naive path passes it), selects its top-k, and its multi-latent attention attends to those keys
only; layers without one take the last one's selection. The indexer loss — the KL divergence of
the indexer's softmax over the selected keys from the main attention's probabilities there
(summed over heads, normalised; both clamped at 1e-8, as the fused NPU kernel documents it) over
the rows, times the coefficient — reaches the indexer's weights only, its gradient scaled by
1 / the micro-batches (the auto-scaler's). RoPE on the indexer's first rotated dimensions is
megatron-core's own `apply_rotary_pos_emb` with YaRN's mscale (`--apply-rope-no-in-complex`)."""

import math

import torch

EPS = 1e-8


class Indexer(torch.nn.Module):
    """`DSAIndexer`'s weights (nn.Linear layout) and key LayerNorm."""

    def __init__(self, hidden, q_lora, heads, dim):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.wq_b = torch.nn.Linear(q_lora, heads * dim, bias=False)
        self.wk = torch.nn.Linear(hidden, dim, bias=False)
        self.k_norm = torch.nn.LayerNorm(dim, eps=1e-6)
        self.weights_proj = torch.nn.Linear(hidden, heads, bias=False)


class AutoScaler(torch.autograd.Function):
    """`DSAIndexerLossAutoScaler`: the loss rides on the attention's output, its gradient the
    main loss's backward scale."""

    scale = 1.0

    @staticmethod
    def forward(ctx, output, loss):
        ctx.save_for_backward(loss)
        return output

    @staticmethod
    def backward(ctx, grad):
        (loss,) = ctx.saved_tensors
        return grad, torch.ones_like(loss) * AutoScaler.scale


def rope(t, attention, config):
    """megatron-core's MLA RoPE (YaRN's frequencies and mscale) of `t [s, b, n, dr]`."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    emb = attention.rotary_pos_emb(t.shape[0])
    emb, mscale = emb if isinstance(emb, tuple) else (emb, 1.0)
    return apply_rotary_pos_emb(t, emb, config=config, mscale=mscale)


class Dsa:
    """The sparse attention of a GPTModel's multi-latent attention layers: `computes[l]` says
    whether decoder layer l has its own indexer (attached as `self_attention.dsa_indexer`, so
    that a Megatron state dict loads into it). `losses` collects each micro-batch's per-layer
    indexer losses (the coefficient included) for the logged `dsa_indexer_loss`."""

    def __init__(self, gpt, a, computes, *, heads, dim, topk, coeff):
        self.topk, self.coeff, self.computes = topk, coeff, computes
        self.selection, self.losses = None, []
        self.rope_dim = a.qk_pos_emb_head_dim
        gpt.register_forward_pre_hook(
            lambda m, args: self.losses.append([0.0] * len(self.computes)))
        for l, layer in enumerate(gpt.decoder.layers):
            attention = layer.self_attention
            if computes[l]:
                attention.dsa_indexer = Indexer(a.hidden_size, a.q_lora_rank, heads, dim)
            self._patch(attention, l)

    def _patch(self, attention, l):
        seen = {}
        attention.register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
        attention.linear_q_down_proj.register_forward_hook(
            lambda m, args, out: seen.update(qr=out[0] if isinstance(out, tuple) else out))
        core = attention.core_attention

        def forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if self.computes[l]:
                self.selection, scores = self.select(attention, seen["x"].detach(),
                                                     seen["qr"].detach())
            chosen = self.selection
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            logits = q @ k.transpose(-1, -2) * core.scale
            s = logits.shape[-1]
            valid = chosen >= 0
            hits = torch.zeros(q.shape[0], s, s).scatter_add_(-1, chosen.clamp(min=0),
                                                             valid.float())
            allowed = hits > 0
            causal = torch.ones(s, s, dtype=torch.bool).tril()
            allowed &= causal
            probs = logits.masked_fill(~allowed[:, None], float("-inf")).softmax(-1)
            out = (probs @ v).permute(2, 0, 1, 3).reshape(s, q.shape[0], -1)
            if self.computes[l] and torch.is_grad_enabled():
                loss = self.loss(probs.detach(), scores, chosen)
                self.losses[-1][l] += loss.item()
                out = AutoScaler.apply(out, loss)
            return out

        core.forward = forward

    def select(self, attention, x, qr):
        """The top-k keys `[b, s, topk]` (−1 past the keys a row sees) and their scores."""
        ix = attention.dsa_indexer
        s, b, _ = x.shape
        q = ix.wq_b(qr).view(s, b, ix.heads, ix.dim)
        k = ix.k_norm(ix.wk(x)).view(s, b, 1, ix.dim)
        r = self.rope_dim
        q = torch.cat([rope(q[..., :r], attention, attention.config), q[..., r:]], -1)
        k = torch.cat([rope(k[..., :r], attention, attention.config), k[..., r:]], -1)
        w = ix.weights_proj(x) * ix.heads ** -0.5 * ix.dim ** -0.5
        # [b, s, s]: Σ_j w_tj relu(q_tj·k_s)
        dots = torch.einsum("tbjd,sbd->btjs", q, k[:, :, 0]).relu()
        index = torch.einsum("btjs,tbj->bts", dots, w)
        future = torch.ones(s, s, dtype=torch.bool).triu(1)
        index = index.masked_fill(future, float("-inf"))
        # a stable sort, as the fused NPU indexer's golden reference takes its top-k (ties — the
        # relu's zeros — to the earlier key; torch.topk's order among equals is unspecified)
        scores, keys = index.sort(dim=-1, descending=True, stable=True)
        scores, keys = scores[..., :self.topk], keys[..., :self.topk]
        keys = torch.where(keys <= torch.arange(s)[None, :, None], keys, -1)
        return keys, scores

    def loss(self, probs, scores, keys):
        """The indexer loss of the main attention's `probs [b, heads, s, s]`."""
        b, _, s, _ = probs.shape
        valid = keys >= 0
        target = probs.sum(1).gather(-1, keys.clamp(min=0)).masked_fill(~valid, 0.0)
        target = (target / target.sum(-1, keepdim=True)).clamp(min=EPS).masked_fill(~valid, 0.0)
        y = scores.masked_fill(~valid, float("-inf")).softmax(-1)
        kl = target * (target.clamp(min=EPS).log() - y.clamp(min=EPS).log())
        return self.coeff * kl.masked_fill(~valid, 0.0).sum() / (b * s)

    def step_losses(self, micro_batches):
        """The logged `dsa_indexer_loss` of the step of the first `micro_batches` micro-batches
        not yet taken."""
        taken, self.losses = self.losses[:micro_batches], self.losses[micro_batches:]
        return sum(sum(m) for m in taken) / micro_batches / len(self.computes)
