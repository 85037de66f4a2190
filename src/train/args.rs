//! `mindkit train`'s command line: Megatron-LM's and MindSpeed-LLM's own flag names, parsed the
//! way their argparse does (`--flag value`, `--flag=value`, lists up to the next flag, flags
//! that take no value), so that a launch script runs with only the program name changed.
//!
//! Every flag mindkit knows is in [`FLAGS`] with what it does here: used, accepted without
//! effect on this engine (kernel choices, overlap, memory tricks — listed by `--help`), or
//! refused because it would change the result and is not implemented. An unknown flag is an
//! error, as it is for Megatron.

use std::collections::HashMap;

/// How a flag takes its value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Takes {
    /// No value (`store_true`).
    Nothing,
    /// One value.
    One,
    /// One or more values, up to the next flag.
    List,
}

/// What a flag does in mindkit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Effect {
    /// Implemented (its value may still be checked when resolved).
    Used,
    /// Accepted, no effect on the result: the reason says why.
    NoEffect(&'static str),
    /// Would change the result and is not implemented: using it is an error with this reason.
    Refused(&'static str),
}

/// One known flag.
#[derive(Debug, Clone, Copy)]
pub struct Flag {
    /// Its name without the leading dashes.
    pub name: &'static str,
    /// Its value.
    pub takes: Takes,
    /// What it does here.
    pub effect: Effect,
    /// One line of help.
    pub help: &'static str,
}

const fn used(name: &'static str, takes: Takes, help: &'static str) -> Flag {
    Flag {
        name,
        takes,
        effect: Effect::Used,
        help,
    }
}

const fn inert(name: &'static str, takes: Takes, why: &'static str) -> Flag {
    Flag {
        name,
        takes,
        effect: Effect::NoEffect(why),
        help: why,
    }
}

const fn refused(name: &'static str, takes: Takes, why: &'static str) -> Flag {
    Flag {
        name,
        takes,
        effect: Effect::Refused(why),
        help: why,
    }
}

use Takes::{List, Nothing, One};

const KERNEL: &str = "picks a CUDA/NPU kernel; the math is the same";
const OVERLAP: &str =
    "overlaps communication with computation; mindkit runs them in turn, the result is the same";
const MEMORY: &str = "saves device memory; the result is the same";
const LAUNCH: &str =
    "a launcher or cluster setting; the ranks meet through the launcher's environment and store";

/// Every flag `mindkit train` knows.
pub const FLAGS: &[Flag] = &[
    // Model architecture.
    used("num-layers", One, "decoder layers"),
    used("hidden-size", One, "hidden size"),
    used("ffn-hidden-size", One, "MLP width (default for SwiGLU: int(8h/3/64)·64; otherwise 4h)"),
    used("num-attention-heads", One, "attention heads"),
    used("group-query-attention", Nothing, "use --num-query-groups key/value heads"),
    used("num-query-groups", One, "key/value heads with --group-query-attention"),
    used("kv-channels", One, "per-head dimension (default hidden/heads)"),
    used("seq-length", One, "tokens per sample"),
    used("max-position-embeddings", One, "positions the model is built for"),
    used("normalization", One, "RMSNorm (default; the LLaMA family) or LayerNorm (with a bias, Phi-3.5-MoE)"),
    used("norm-epsilon", One, "the norms' epsilon (default 1e-5)"),
    used("swiglu", Nothing, "SwiGLU MLP (the LLaMA family; this or --squared-relu is required)"),
    used("squared-relu", Nothing, "a non-gated MLP with relu(x)² (PLM's; megatron-core's squared_relu)"),
    used("fc-type", One, "MindSpeed-LLM's MLP structure: up_down (one non-gated projection, with --squared-relu) or gate_up"),
    used("position-embedding-type", One, "rope (required)"),
    used("use-rotary-position-embeddings", Nothing, "deprecated alias of --position-embedding-type rope"),
    used("rotary-base", One, "RoPE theta (default 10000)"),
    used("rotary-percent", One, "fraction of each query and key head RoPE rotates (default 1.0; the rest passed through)"),
    used("use-rope-scaling", Nothing, "llama3 RoPE scaling (Megatron-LM)"),
    used("rope-scaling-factor", One, "RoPE scaling factor"),
    used("rope-scaling-type", One, "MindSpeed-LLM RoPE scaling: llama3, yarn or longrope"),
    used("longrope-freqs-type", One, "LongRoPE (--rope-scaling-type longrope): mul (default: the positions divided by each frequency's factor) or outer (the inverse frequencies divided), as MindSpeed-LLM computes the angles"),
    used("long-factor", One, "LongRoPE: comma-separated factors of each frequency, used when --seq-length exceeds --rope-scaling-original-max-position-embeddings"),
    used("short-factor", One, "LongRoPE: comma-separated factors of each frequency, used otherwise"),
    used("long-mscale", One, "LongRoPE: the attention factor beyond the original context (with --short-mscale; without both, √(1 + ln(max / original) / ln original))"),
    used("short-mscale", One, "LongRoPE: the attention factor within the original context"),
    used("low-freq-factor", One, "llama3 RoPE scaling"),
    used("high-freq-factor", One, "llama3 RoPE scaling"),
    used("original-max-position-embeddings", One, "llama3 RoPE scaling"),
    used("disable-bias-linear", Nothing, "no biases in linear layers"),
    used("add-qkv-bias", Nothing, "bias on linear_qkv only (Qwen2)"),
    used("add-dense-bias", Nothing, "MindSpeed-LLM: bias on the attention's linear_proj (with --add-qkv-bias: Phi-3.5-MoE's spec)"),
    used("add-output-layer-bias", Nothing, "MindSpeed-LLM: bias on the output layer (untied)"),
    used("untie-embeddings-and-output-weights", Nothing, "a separate output layer"),
    used("make-vocab-size-divisible-by", One, "pad the vocabulary to a multiple of this (default 128)"),
    used("padded-vocab-size", One, "MindSpeed-LLM: the padded vocabulary, given"),
    inert("vocab-size", One, "only read by Null tokenizers; the vocabulary comes from the tokenizer"),
    used("attention-dropout", One, "dropout on the attention probabilities in training (default 0.1; mindkit's own masks; not on NPU)"),
    used("hidden-dropout", One, "dropout on the embedding, attention and MLP outputs in training (default 0.1; mindkit's own masks)"),
    used("init-method-std", One, "std of the normal init (default 0.02; output layers σ/√(2L))"),
    used("embedding-init-method-std", One, "std of the embedding init (also exempts it from weight decay)"),
    used("transformer-impl", One, "local (mcore local names, as MindSpeed-LLM) or transformer_engine (TE names) in saved checkpoints"),
    inert("use-mcore-models", Nothing, "mcore models are the only models"),
    used("model-type-hf", One, "MindSpeed-LLM: the family of an HF --load directory"),
    used("enable-hf2mg-convert", Nothing, "MindSpeed-LLM: --load may be an HF directory (always true here)"),
    refused("apply-layernorm-1p", Nothing, "zero-centred norm weights are not implemented"),
    used("qk-layernorm", Nothing, "RMSNorm of each query and key head before RoPE (Qwen3); of all heads at once with the MiniMax spec"),
    used("spec", List, "MindSpeed-LLM's layer spec module and function: mindspeed_llm.tasks.models.spec.qwen3_spec or bailing_spec layer_spec (the local spec; q/k norms with --qk-layernorm), phi35_moe_spec layer_spec (the local spec: --normalization's norms, --add-dense-bias), minimax_spec layer_spec (the same, each q/k norm over all heads; TP 1), deepseek_spec layer_spec (multi-latent attention, its down projections in one replicated linear_qkv; --transformer-impl local)"),
    used("enable-mla-scale-q-lora", Nothing, "MindSpeed-LLM's: multi-latent attention's normed query latent times √(hidden / q-lora-rank) before its up projection (LongCat-Flash)"),
    used("enable-mla-scale-kv-lora", Nothing, "MindSpeed-LLM's: the normed key-value latent times √(hidden / kv-lora-rank) before its up projection (LongCat-Flash)"),
    used("mla-mm-split", Nothing, "MindSpeed-LLM's (with its deepseek_spec): each multi-latent up projection as two, linear_qk_nope / linear_qk_rope and linear_kv_nope / linear_v, in checkpoints and in the optimizer's state"),
    used("multi-latent-attention", Nothing, "multi-latent attention (DeepSeek-V2/V3; megatron-core's MLASelfAttention, local spec names; its latents' norms with --qk-layernorm)"),
    used("q-lora-rank", One, "multi-latent attention's query latent (none: queries projected from the hidden state; without --multi-latent-attention nothing reads it, as MindSpeed-LLM's MiniMax script passes it)"),
    used("kv-lora-rank", One, "multi-latent attention's key-value latent (default 32; nothing reads it without --multi-latent-attention)"),
    used("qk-head-dim", One, "multi-latent attention: a query/key head's dimensions without RoPE (default 128)"),
    used("qk-pos-emb-head-dim", One, "multi-latent attention: the rotated dimensions of a query head and of the key part all heads share (default 64)"),
    used("v-head-dim", One, "multi-latent attention: a value head's dimensions (default 128)"),
    used("enable-dsa-indexer", Nothing, "MindSpeed-LLM's DeepSeek sparse attention: a lightning indexer picks the keys each query of multi-latent attention attends to, trained by its own KL loss (CPU; TP 1)"),
    used("index-n-heads", One, "DeepSeek sparse attention: the indexer's heads (default 64)"),
    used("index-head-dim", One, "DeepSeek sparse attention: the indexer's head dimension (default 128)"),
    used("index-topk", One, "DeepSeek sparse attention: keys each query attends to (default 2048)"),
    used("indexer-loss-coeff", One, "DeepSeek sparse attention: the indexer loss's coefficient (default 1), logged as dsa_indexer_loss"),
    used("index-topk-freq", One, "DeepSeek sparse attention: every how many layers one has its own indexer, the rest sharing the last one's keys (default 1)"),
    used("index-skip-topk-offset", One, "DeepSeek sparse attention: the layers up to this one (1-based) have their own indexer (default 2)"),
    used("apply-rope-no-in-complex", Nothing, "DeepSeek sparse attention: the indexer's RoPE on neighbouring pairs of dimensions (else on halves, MindSpeed-LLM's complex RoPE)"),
    used("enable-mla-absorb", Nothing, "MindSpeed-LLM's absorbed multi-latent attention (same scores, another order of products); with --use-sparse-flash-attn and --mla-mm-split the indexer reads the normed query latent, as its absorbed path does"),
    used("use-sparse-flash-attn", Nothing, "MindSpeed-LLM's sparse flash attention kernel for DeepSeek sparse attention (the same attention); with --enable-mla-absorb and --mla-mm-split it selects the absorbed path"),
    inert("use-fused-lightning-indexer", Nothing, "MindSpeed-LLM's fused NPU lightning indexer: the same scores and selection"),
    inert("use-fused-lightning-indexer-loss", Nothing, "MindSpeed-LLM's fused NPU indexer loss, whose documented formula mindkit computes"),
    inert("no-use-sparse-c8-indexer", Nothing, "the indexer's Hadamard rotation of its queries and keys is orthonormal: their dot products are the same without it"),
    inert("index-share-for-mtp-iteration", Nothing, "MindSpeed-LLM declares it and reads it nowhere: a multi-token prediction depth always has its own indexer"),
    refused("index-topk-pattern", One, "the layers' compute/share pattern is not built (--index-topk-freq and --index-skip-topk-offset are)"),
    refused("kv-compress", Nothing, "DeepSeek-V4's compressed indexer is not built"),
    used("init-norm-weight-in-fp32", Nothing, "every norm's weights kept in f32 under --bf16 (MindSpeed-LLM's): trained and saved in f32, the norms' outputs still bf16"),
    used("rope-scaling-mscale", One, "YaRN (--rope-scaling-type yarn): the mscale of the attention factor (default 1)"),
    used("rope-scaling-mscale-all-dim", One, "YaRN: the mscale of the attention factor's divisor and of multi-latent attention's softmax scale (default 0)"),
    used("rope-scaling-original-max-position-embeddings", One, "YaRN: the context the model was pretrained for (default 4096)"),
    used("beta-fast", One, "YaRN: the ramp's fast boundary (default 32)"),
    used("beta-slow", One, "YaRN: the ramp's slow boundary (default 1)"),
    used("mtp-num-layers", One, "multi-token prediction depths (DeepSeek-V3's MTP modules; megatron-core's MultiTokenPredictionBlock on the last pipeline stage), their losses logged as mtp_N loss"),
    used("mtp-loss-scaling-factor", One, "the weight of the multi-token prediction losses, shared evenly by the depths (default 0.1)"),
    used("mtp-layout", One, "mindkit's: mindspeed (default, MindSpeed-LLM's MTP: the decoder's final norm after the depths, each depth handed the un-normed states; final_layernorm, mtp.final_layernorms.N) or mcore (megatron-core 0.15's: normed states handed on; decoder.final_layernorm, mtp.layers.N.final_layernorm); a --load checkpoint's by default"),
    inert("mtp-mem-efficient-logits", Nothing, "MindSpeed-LLM's: the multi-token prediction cross entropy's logits maximum taken in place; the math is the same"),
    refused("mtp-spec", List, "MindSpeed-LLM's custom layer spec of the multi-token prediction depths (DeepSeek-V4's) is not built; without it a depth's layer is the decoder's last layer's kind"),
    // Mixture of experts (megatron-core 0.15; MindSpeed-LLM's where named).
    used("num-experts", One, "routed experts per MoE layer (megatron-core's MoELayer: router, SequentialMLP experts, shared experts)"),
    used("num-zero-experts", One, "zero-computation experts beside the routed ones (MindSpeed-LLM, LongCat-Flash): each gives back its token's input times the routing weight"),
    used("moe-router-topk", One, "experts per token (default 2)"),
    used("moe-ffn-hidden-size", One, "one routed expert's intermediate size (default --ffn-hidden-size)"),
    used("moe-intermediate-size", One, "MindSpeed-LLM: --moe-ffn-hidden-size"),
    used("moe-router-score-function", One, "softmax (default) or sigmoid"),
    used("moe-router-pre-softmax", Nothing, "softmax over all experts before the top-k (the chosen probabilities then not renormalised)"),
    used("norm-topk-prob", Nothing, "MindSpeed-LLM: renormalise the chosen experts' probabilities (a softmax over the chosen logits)"),
    used("moe-router-topk-scaling-factor", One, "scale of the routing weights"),
    used("moe-router-num-groups", One, "group-limited routing: expert groups"),
    used("moe-router-group-topk", One, "group-limited routing: groups a token may use"),
    used("moe-layer-freq", One, "which layers are MoE: every k-th (Python's modulo: -1 is every layer) or a pattern like [0]*3+[1]*29"),
    used("first-k-dense-replace", One, "MindSpeed-LLM: the first k layers dense (-1: none)"),
    used("moe-shared-expert-intermediate-size", One, "the shared experts' intermediate size"),
    used("n-shared-experts", One, "MindSpeed-LLM: shared experts of the routed experts' size"),
    used("shared-expert-gate", Nothing, "MindSpeed-LLM: a sigmoid gate on the shared experts' output (Qwen2-MoE)"),
    used("moe-router-load-balancing-type", One, "aux_loss (default), seq_aux_loss, sinkhorn (training routes each router call by its Sinkhorn-balanced logits), none; MindSpeed-LLM's softmax_topk, sparsemixer_topk (Phi-3.5-MoE's SparseMixer top-2: sampled in training with mindkit's own draws), pai_megatron_aux_loss and group_limited_greedy (DeepSeek-V2's routing: a softmax over all experts, the top-k within the best --moe-router-group-topk of --moe-router-num-groups groups, each group scored by its best expert; both group flags required here; its balance losses are not built: coefficients 0)"),
    used("moe-input-jitter-eps", One, "in training each router's input times U(1 − ε, 1 + ε), mindkit's own draws (megatron-core's apply_input_jitter; not in evaluation)"),
    used("moe-aux-loss-coeff", One, "the load-balancing loss's coefficient (default 0)"),
    used("moe-z-loss-coeff", One, "the router z-loss's coefficient (default none)"),
    used("moe-token-dispatcher-type", One, "allgather, alltoall or alltoall_seq: how tokens reach their experts' ranks; the same math (each expert's tokens and outputs the same), carried out here as the all-gather dispatcher does it"),
    used("expert-tensor-parallel-size", One, "the experts' tensor-parallel size: the tensor-parallel size"),
    used("moe-router-dtype", One, "fp32: the router's product, logits and routing weights in f32 under --bf16"),
    used("router-gating-in-fp32", Nothing, "MindSpeed-LLM: --moe-router-dtype fp32"),
    used("moe-tp-extend-ep", Nothing, "MindSpeed-LLM: experts whole, spread over the TP × EP ranks instead of split over TP (the same layer at TP 1)"),
    used("gemm-gradient-accumulation-fusion", Nothing, "MindSpeed: grouped experts' weight gradients add into the f32 main gradients unrounded under --bf16 (otherwise each micro-batch's are rounded to bf16, as the grouped matmul's bf16 gradients are)"),
    used("moe-grouped-gemm", Nothing, "MindSpeed-LLM's GroupedMLP, or megatron-core's TEGroupedMLP with --transformer-impl transformer_engine: the same experts' math, saved as mlp.experts.weight1 / weight2 (one optimizer parameter each), or as mlp.experts.linear_fc1.weight{i} (one per expert)"),
    used("moe-router-enable-expert-bias", Nothing, "aux-loss-free balancing: an expert bias [E] (f32, saved as mlp.router.expert_bias) added to the sigmoid scores for the choice of experts, moved after each step towards the experts that got fewer tokens"),
    used("moe-router-bias-update-rate", One, "how far the expert bias moves per step (default 1e-3)"),
    used("moe-expert-capacity-factor", One, "token dropping: each expert takes at most ceil(T·k/E · factor) of a router call's T tokens (negative: dropless)"),
    used("moe-token-drop-policy", One, "which tokens an expert over its capacity keeps: probs (the highest weights, default) or position (the first)"),
    used("moe-pad-expert-input-to-capacity", Nothing, "every expert computes its capacity of tokens, the padding with weight 0: the same output; the expert bias then counts the capacity for every expert, as megatron-core does"),
    used("moe-device-level-aux-loss-coeff", One, "MindSpeed-LLM's group_limited_greedy device-level balance loss coefficient: 0 (default); above 0 refused (not built)"),
    used("moe-comm-aux-loss-coeff", One, "MindSpeed-LLM's group_limited_greedy communication balance loss coefficient: 0 (default); above 0 refused (not built)"),
    used("seq-aux", Nothing, "MindSpeed-LLM's: with --moe-router-load-balancing-type none, DeepSeek-V3's complementary sequence-wise balance loss (--moe-aux-loss-coeff) on the experts routed; the other types ignore it there and here"),
    inert("moe-permutation-async-comm", Nothing, OVERLAP),
    inert("moe-alltoall-overlap-comm", Nothing, OVERLAP),
    inert("moe-allgather-overlap-comm", Nothing, OVERLAP),
    inert("moe-fb-overlap", Nothing, OVERLAP),
    used("schedules-method", One, "MindSpeed's dualpipev: each stage's layers in two chunks in a V (chunk 0 counting up, chunk 1 down; the first stage also holds the output layer and the loss), saved in that layout (not yet with --mtp-num-layers); mindkit runs the V forward, then backward (not DualPipeV's overlapped order: the same sums in the same order, more activations held); 2 or more pipeline stages, as MindSpeed requires"),
    inert("dualpipev-dw-detach", Nothing, OVERLAP),
    inert("moe-permute-fusion", Nothing, KERNEL),
    inert("use-fused-moe-token-permute-and-unpermute", Nothing, KERNEL),
    inert("moe-zero-memory", One, MEMORY),
    inert("disable-gloo-group", Nothing, "MindSpeed: no gloo process groups beside HCCL's (the distributed optimizer's checkpoint gathers then use HCCL); mindkit's groups are its own, the result is the same"),
    refused("fp16", Nothing, "fp16 training with loss scaling is not implemented; use --bf16"),
    refused("fp32-residual-connection", Nothing, "an f32 residual stream under --bf16 is not implemented"),
    refused("apply-query-key-layer-scaling", Nothing, "query-key layer scaling is not implemented"),
    // Tokenizer.
    used("tokenizer-type", One, "HuggingFaceTokenizer, PretrainedFromHF, Llama2Tokenizer or MagistralTokenizer (a tekken.json)"),
    used("tokenizer-model", One, "tokenizer file or directory"),
    used("tokenizer-name-or-path", One, "tokenizer directory (MindSpeed-LLM)"),
    inert("tokenizer-not-use-fast", Nothing, "the tokenizer is Hugging Face tokenizers' own"),
    used("prompt-type", One, "MindSpeed-LLM template: its eos/pad decide the EOD and pad ids"),
    used("prompt-type-path", One, "templates.json holding --prompt-type"),
    // Data.
    used("data-path", List, "PREFIX, or W1 PREFIX1 W2 PREFIX2 … (Megatron's blend)"),
    used("split", One, "train, valid, test weights (default 969, 30, 1)"),
    used("seed", One, "data order seed (default 1234)"),
    refused("train-data-path", List, "separate per-split blends are not implemented; use --data-path and --split"),
    refused("valid-data-path", List, "separate per-split blends are not implemented; use --data-path and --split"),
    refused("test-data-path", List, "separate per-split blends are not implemented; use --data-path and --split"),
    inert("data-cache-path", One, "indices are built in memory in seconds, not cached"),
    inert("mmap-bin-files", Nothing, "the .bin files are always memory-mapped"),
    inert("no-mmap-bin-files", Nothing, "the .bin files are always memory-mapped"),
    inert("num-workers", One, "data loading is in-process"),
    used("dataloader-type", One, "single (Megatron's default: the split in order) or cyclic (its random sampler: each data-parallel rank's bucket shuffled per epoch as torch.randperm shuffles it, epoch after epoch)"),
    used("no-data-sharding", Nothing, "nothing with single; refused with cyclic (Megatron's sampler without sharding is not implemented; MindSpeed-LLM ignores the flag)"),
    used("eod-mask-loss", Nothing, "no loss on the prediction made after an EOD"),
    used("reset-position-ids", Nothing, "accepted; RoPE never reads position ids in Megatron"),
    used("reset-attention-mask", Nothing, "attention never crosses an EOD"),
    inert("no-create-attention-mask-in-dataloader", Nothing, "masks are never materialised"),
    used("mid-level-dataset-surplus", One, "blend sample surplus (default 0.005)"),
    used("is-instruction-dataset", Nothing, "MindSpeed-LLM fine-tuning data (_packed_* files)"),
    used("stage", One, "MindSpeed-LLM: sft, or dpo (direct preference optimisation against the starting weights)"),
    used("is-pairwise-dataset", Nothing, "MindSpeed-LLM: preference pairs (_packed_{chosen,rejected}_* files) for --stage dpo"),
    used("dpo-loss-type", One, "MindSpeed-LLM: sigmoid (default), hinge or ipo"),
    used("dpo-beta", One, "MindSpeed-LLM: DPO's beta (default 0.1)"),
    used("dpo-label-smoothing", One, "MindSpeed-LLM: the sigmoid loss's label smoothing, 0 to 0.5 (default 0)"),
    used("pref-ftx", One, "MindSpeed-LLM: the weight of the chosen answers' mean negative log likelihood in the DPO loss (default 0)"),
    used("ref-model", One, "MindSpeed-LLM: the DPO reference; only the --load checkpoint (the weights training starts from) is built"),
    inert("npu-deterministic", Nothing, "MindSpeed: deterministic NPU kernels; mindkit's results are deterministic always"),
    inert("use-deter-comp", Nothing, "MindSpeed-LLM's deprecated alias of --npu-deterministic; mindkit's results are deterministic always"),
    inert("variable-seq-lengths", Nothing, "pipeline stages exchange each micro-batch's own length here; the math is the same"),
    inert("refer-model-iter", One, "MindSpeed-LLM: the reference's iteration when resuming DPO, which is refused here"),
    used("padded-samples", Nothing, "MindSpeed-LLM: pad the epoch to a multiple of the global batch"),
    used("no-pad-to-seq-lengths", Nothing, "MindSpeed-LLM: pad a micro-batch only to its longest sample"),
    used("pad-to-multiple-of", One, "MindSpeed-LLM: with --no-pad-to-seq-lengths, pad to a multiple of this (default 8)"),
    used("no-shuffle", Nothing, "MindSpeed-LLM: fine-tuning samples in file order"),
    used("neat-pack", Nothing, "MindSpeed-LLM: packed samples keep their boundaries"),
    inert("handler-name", One, "used by preprocessing; the data here is already .bin/.idx"),
    inert("enable-thinking", One, "used by preprocessing (MindSpeed-LLM's reasoning templates); the data here is already .bin/.idx"),
    inert("pack", Nothing, "used by preprocessing; the data here is already .bin/.idx (packed or not, as mindkit preprocess wrote it)"),
    inert("workers", One, "preprocessing workers (MindSpeed-LLM converts raw data with them); the data here is already .bin/.idx"),
    inert("attention-mask-type", One, "how the NPU flash attention receives the mask (causal, or a general mask tensor); the mask itself follows --reset-attention-mask either way"),
    inert("cp-attention-mask-type", One, "MindSpeed-LLM's deprecated alias of --attention-mask-type (deprecated_args.py): how the NPU flash attention receives the mask; the mask itself follows --reset-attention-mask either way"),
    refused("full-shuffle-instruction-dataset", Nothing, "MindSpeed-LLM's full shuffle is not implemented"),
    // Batches and length.
    used("micro-batch-size", One, "samples per forward/backward pass"),
    used("global-batch-size", One, "samples per optimizer step (a multiple of the micro batch)"),
    used("train-iters", One, "iterations"),
    used("train-samples", One, "samples (instead of --train-iters)"),
    refused("rampup-batch-size", List, "batch-size ramp-up is not implemented"),
    // Optimizer and schedule.
    used("optimizer", One, "adam (AdamW, decoupled decay)"),
    used("lr", One, "peak learning rate"),
    used("min-lr", One, "final learning rate (default 0)"),
    used("lr-decay-style", One, "constant, linear, cosine, inverse-square-root, WSD"),
    used("lr-decay-iters", One, "decay length (default --train-iters)"),
    used("lr-decay-samples", One, "decay length in samples"),
    used("lr-warmup-iters", One, "warmup length"),
    used("lr-warmup-samples", One, "warmup length in samples"),
    used("lr-warmup-fraction", One, "warmup as a fraction of the decay"),
    used("lr-warmup-init", One, "learning rate at step 0 of warmup (default 0)"),
    used("lr-wsd-decay-style", One, "WSD anneal: exponential, linear, cosine, minus_sqrt"),
    used("lr-wsd-decay-iters", One, "WSD anneal length"),
    used("lr-wsd-decay-samples", One, "WSD anneal length in samples"),
    used("weight-decay", One, "decoupled weight decay (default 0.01)"),
    used("start-weight-decay", One, "weight decay at the start (with an increment style)"),
    used("end-weight-decay", One, "weight decay at the end"),
    used("weight-decay-incr-style", One, "constant, linear, cosine"),
    used("adam-beta1", One, "default 0.9"),
    used("adam-beta2", One, "default 0.999"),
    used("adam-eps", One, "default 1e-8"),
    used("clip-grad", One, "global gradient-norm clip (default 1.0; 0: off)"),
    used("calculate-per-token-loss", Nothing, "average the loss over all tokens of the step"),
    used("use-checkpoint-opt-param-scheduler", Nothing, "resume the schedule from the checkpoint"),
    used("override-opt-param-scheduler", Nothing, "resume with the schedule of the command line"),
    refused("decoupled-lr", One, "a separate embedding/output learning rate is not implemented"),
    used("bf16", Nothing, "bf16 weights and activations, f32 main parameters and gradients"),
    used("o2-optimizer", Nothing, "AdamW's moments stored in bf16, stepped in f32 and rounded back after every step (MindSpeed-LLM's O2AdamW); moments loaded from a checkpoint stay f32, as there"),
    inert("o2-gradient", Nothing, "MindSpeed-LLM registers it but nothing reads it any more (its consumer was removed); gradients are accumulated in f32"),
    inert("initial-loss-scale", One, "only read by fp16 training"),
    inert("loss-scale-window", One, "only read by fp16 training"),
    inert("min-loss-scale", One, "only read by fp16 training"),
    inert("accumulate-allreduce-grads-in-fp32", Nothing, "gradients are always accumulated in f32"),
    used("check-for-nan-in-loss-and-grad", Nothing, "on by default"),
    used("no-check-for-nan-in-loss-and-grad", Nothing, "let NaN losses through (Megatron's escape hatch)"),
    inert("rerun-mode", One, "mindkit's NaN policy is its own: a non-finite loss or gradient norm skips the update and is counted"),
    // Checkpoints.
    used("save", One, "checkpoint directory to write"),
    used("save-interval", One, "iterations between checkpoints"),
    used("load", One, "checkpoint to start from (Megatron torch format, or an HF directory)"),
    used("finetune", Nothing, "load weights only, start at iteration 0"),
    used("no-load-optim", Nothing, "do not load the optimizer and schedule state"),
    used("no-load-rng", Nothing, "do not load RNG state (mindkit keeps none)"),
    used("no-save-optim", Nothing, "checkpoints without optimizer state"),
    used("no-save-rng", Nothing, "checkpoints without RNG state (mindkit writes none)"),
    used("ckpt-format", One, "torch (one model_optim_rng.pt per rank) or torch_dist (megatron-core's distributed checkpoint)"),
    inert("auto-detect-ckpt-format", Nothing, "the format of --load is always detected"),
    refused("ckpt-convert-format", One, "a training launch that only converts --load: `mindkit convert --to megatron --ckpt-format torch|torch_dist` does it without one"),
    refused("ckpt-convert-save", One, "with --ckpt-convert-format: `mindkit convert --output` does it"),
    inert("ckpt-convert-update-legacy-dist-opt-format", Nothing, "only with --ckpt-convert-format, which is refused"),
    inert("use-dist-ckpt", Nothing, "deprecated in Megatron, where it has no effect"),
    inert("dist-ckpt-format", One, "deprecated in Megatron, where it has no effect"),
    inert("ckpt-fully-parallel-save", Nothing, "deprecated in Megatron, where it has no effect"),
    inert("no-ckpt-fully-parallel-save", Nothing, "how torch_dist saves spread the writing over ranks; the chunks written are the same (mindkit's ranks each write their own)"),
    inert("ckpt-fully-parallel-load", Nothing, "how torch_dist loads spread the reading over ranks; the weights read are the same"),
    inert("ckpt-assume-constant-structure", Nothing, "a torch_dist save's cached plan; the checkpoint written is the same"),
    inert("dist-ckpt-strictness", One, "how megatron-core treats a torch_dist checkpoint's missing and unexpected keys; mindkit reads one only when every model tensor is there and nothing unknown is"),
    inert("dist-ckpt-save-pre-mcore-014", Nothing, "the distributed optimizer's torch_dist state for megatron-core before 0.14; mindkit saves it fully_reshardable, which 0.14 and later load"),
    inert("dist-ckpt-optim-fully-reshardable", Nothing, "the distributed optimizer's torch_dist state saved fully_reshardable: mindkit always saves it so"),
    inert("distrib-optim-fully-reshardable-mem-efficient", Nothing, "how megatron-core gathers a fully_reshardable save; the state written is the same"),
    inert("async-save", Nothing, "when the checkpoint is written, not what: mindkit writes it before going on"),
    inert("use-persistent-ckpt-worker", Nothing, "with --async-save only"),
    used("use-checkpoint-args", Nothing, "architecture from --load (also done when flags are omitted)"),
    used("exit-interval", One, "save and exit every N iterations"),
    used("exit-duration-in-mins", One, "save and exit after this many minutes"),
    used("exit-signal-handler", Nothing, "save and exit on SIGTERM (and Ctrl-C)"),
    used("exit-on-missing-checkpoint", Nothing, "an empty --load is an error"),
    // LoRA (MindSpeed-LLM).
    used("lora-r", One, "LoRA rank"),
    used("lora-alpha", One, "LoRA alpha (scale alpha/r)"),
    used("lora-target-modules", List, "linear_qkv linear_proj linear_fc1 linear_fc2"),
    used("lora-ckpt-filter", Nothing, "checkpoints hold only the LoRA weights"),
    used("lora-load", One, "LoRA checkpoint to resume from"),
    inert("lora-fusion", Nothing, "a fused kernel for the same product"),
    inert("lora-register-forward-hook", List, "a hook mechanism; the math is the same"),
    refused("lora-modules-to-save", List, "full training of extra modules with LoRA is not implemented"),
    refused("lora-dropout", One, "LoRA dropout is not implemented"),
    // Evaluation and logging.
    used("eval-interval", One, "iterations between validation runs (default 1000)"),
    used("eval-iters", One, "validation iterations per run (default 100)"),
    used("log-interval", One, "iterations between log lines (default 100)"),
    used("log-throughput", Nothing, "add TFLOP/s to the log line"),
    used("log-comm-stats", Nothing, "mindkit: after each log line, what this rank's collectives moved per iteration (calls, bytes) beside Megatron's data-parallel gradient all-reduce"),
    used("tensorboard-dir", One, "write TensorBoard scalars here"),
    used("tensorboard-log-interval", One, "iterations between TensorBoard scalars (default 1)"),
    used("log-validation-ppl-to-tensorboard", Nothing, "also write validation PPL"),
    used("log-params-norm", Nothing, "add the parameters' L2 norm to the log line"),
    used("log-num-zeros-in-grad", Nothing, "add the gradient's zero count to the log line"),
    inert("log-timers-to-tensorboard", Nothing, "no per-kernel timers"),
    inert("log-memory-to-tensorboard", Nothing, "no device memory to report"),
    inert("timing-log-level", One, "no per-kernel timers"),
    inert("wandb-project", One, "Weights & Biases is not built in; use --tensorboard-dir"),
    inert("wandb-exp-name", One, "Weights & Biases is not built in; use --tensorboard-dir"),
    // Parallelism.
    used("world-size", One, "ranks as threads of this process (default TP × PP × EP; one NPU each from --npu-id on with --device npu): data parallelism takes world / (TP × PP) ranks, each training on its slice of every global batch (mindkit's flag; under torchrun or Slurm the launcher's ranks, one process each)"),
    used("rank-table-file", One, "with --device npu under a launcher: join the ranks over HCCL by this rank table (CANN's JSON; default $RANK_TABLE_FILE, as torch_npu reads it) instead of the launcher's store"),
    used("tensor-model-parallel-size", One, "tensor parallelism, Megatron's (default 1)"),
    used("pipeline-model-parallel-size", One, "pipeline parallelism, Megatron's 1F1B schedule (default 1)"),
    used("context-parallel-size", One, "1 (context parallelism is not available)"),
    used("expert-model-parallel-size", One, "expert parallelism (default 1): each MoE layer's routed experts split over EP of the data-parallel ranks, every rank's tokens gathered to them (megatron-core's expert groups: dp = ep + EP × edp); expert gradients summed over the expert-data-parallel ranks"),
    used("sequence-parallel", Nothing, "sequence parallelism with tensor parallelism (switched off at TP 1, as Megatron does)"),
    used("use-distributed-optimizer", Nothing, "Megatron's distributed optimizer: gradients reduce-scattered, each data-parallel rank's Adam state over its 1/DP of the flat buffer, parameters all-gathered; checkpoints with distrib_optim.pt"),
    used("ddp-bucket-size", One, "elements per gradient bucket with --overlap-grad-reduce (Megatron's default max(40M, 1M × DP)): it shapes distrib_optim.pt's layout"),
    used("ddp-num-buckets", One, "with --overlap-grad-reduce, buckets of the rank's parameters / N elements (instead of --ddp-bucket-size)"),
    used("ddp-pad-buckets-for-high-nccl-busbw", Nothing, "pad each gradient bucket to a multiple of lcm(DP, 128, 65536) elements (distrib_optim.pt's layout follows)"),
    used("num-layers-per-virtual-pipeline-stage", One, "layers per model chunk: a virtual pipeline, Megatron's interleaved 1F1B schedule"),
    used("num-virtual-stages-per-pipeline-rank", One, "model chunks per pipeline stage: a virtual pipeline, Megatron's interleaved 1F1B schedule (also with uneven stages)"),
    used("microbatch-group-size-per-virtual-pipeline-stage", One, "micro-batches a model chunk runs in a row in the interleaved schedule (default the pipeline size)"),
    used("no-overlap-p2p-communication", Nothing, "no overlap here either way; Megatron's check that a virtual pipeline then needs more than 2 stages is kept"),
    inert("overlap-p2p-communication-warmup-flush", Nothing, OVERLAP),
    used("decoder-first-pipeline-num-layers", One, "layers of the first pipeline stage, the others spread evenly"),
    used("decoder-last-pipeline-num-layers", One, "layers of the last pipeline stage, the others spread evenly"),
    inert("distributed-backend", One, LAUNCH),
    used("distributed-timeout-minutes", One, "how long a rank waits for the others at a collective or the launcher's store (default 10); HCCL's own waits follow HCCL_CONNECT_TIMEOUT / HCCL_EXEC_TIMEOUT"),
    inert("local-rank", One, LAUNCH),
    inert("local_rank", One, LAUNCH),
    inert("nproc_per_node", One, LAUNCH),
    inert("nnodes", One, LAUNCH),
    inert("node_rank", One, LAUNCH),
    inert("master_addr", One, LAUNCH),
    inert("master_port", One, LAUNCH),
    // Kernel, overlap and memory switches.
    inert("use-flash-attn", Nothing, KERNEL),
    inert("mla-fa-without-pad", Nothing, "MindSpeed-LLM's: multi-latent attention's values not zero-padded to the queries' width for its flash attention kernel; the padding's output is dropped, the math is the same"),
    inert("padded-base-length", One, "MindSpeed-LLM's: the multiple its flash attention kernel pads multi-latent attention's heads to with zeros (BSND layouts); the math is the same"),
    inert("shape-order", One, "the layout (SBH, BSH, BSND, BNSD) MindSpeed feeds its flash attention kernel; the math is the same"),
    inert("use-fused-rmsnorm", Nothing, KERNEL),
    inert("use-fused-swiglu", Nothing, KERNEL),
    inert("use-fused-rotary-pos-emb", Nothing, KERNEL),
    inert("no-masked-softmax-fusion", Nothing, KERNEL),
    inert("masked-softmax-fusion", Nothing, KERNEL),
    inert("attention-softmax-in-fp32", Nothing, "softmax is computed in f32 already"),
    used("no-gradient-accumulation-fusion", Nothing, "under --bf16, each micro-batch's linear-layer weight gradients are rounded to bf16 before they add into the f32 main gradients, as upstream without its fused kernel (the default adds them unrounded, as the fused kernel does); with f32 weights nothing changes"),
    inert("no-bias-dropout-fusion", Nothing, KERNEL),
    inert("no-bias-swiglu-fusion", Nothing, KERNEL),
    inert("no-bias-gelu-fusion", Nothing, KERNEL),
    inert("no-rope-fusion", Nothing, KERNEL),
    inert("cross-entropy-loss-fusion", Nothing, KERNEL),
    inert("use-ascend-mc2", Nothing, KERNEL),
    inert("use-fused-ring-attention-update", Nothing, KERNEL),
    inert("use-cp-send-recv-overlap", Nothing, OVERLAP),
    inert("context-parallel-algo", One, "picks the context-parallel algorithm; context parallelism is 1 here (above 1 is refused)"),
    used("overlap-grad-reduce", Nothing, "no overlap here; with --use-distributed-optimizer it buckets the gradient buffer as Megatron does (--ddp-bucket-size), which distrib_optim.pt's layout follows"),
    inert("overlap-param-gather", Nothing, OVERLAP),
    inert("no-async-tensor-model-parallel-allreduce", Nothing, OVERLAP),
    inert("reuse-fp32-param", Nothing, MEMORY),
    inert("swap-optimizer", Nothing, "MindSpeed's swap of the optimizer state to host memory between steps; saves device memory, the result is the same"),
    inert("swap-optimizer-times", One, "MindSpeed's: how many pieces --swap-optimizer moves the optimizer state in; the result is the same"),
    inert("recompute-granularity", One, MEMORY),
    inert("recompute-method", One, MEMORY),
    inert("recompute-num-layers", One, MEMORY),
    inert("recompute-activation-function", Nothing, MEMORY),
    inert("swap-attention", Nothing, MEMORY),
    inert("use-cpu-initialization", Nothing, "initialisation runs on the host anyway"),
    inert("manual-gc", Nothing, "no garbage collector"),
    inert("manual-gc-interval", One, "no garbage collector"),
    inert("use-ascend-coc", Nothing, "overlaps tensor-parallel collectives with matmuls on the NPU (CoC); the result is the same"),
    inert("coc-fused-kernel", Nothing, KERNEL),
    inert("coc-parallel-num", One, KERNEL),
    inert("no-shared-storage", Nothing, LAUNCH),
    inert("sparse-mode", One, "an NPU flash-attention mask encoding; the mask is causal either way"),
    // mindkit's own.
    used("quiet", Nothing, "mindkit: no progress bar and no start-up notes (log lines still print)"),
    used("device", One, "mindkit: cpu (default), or npu (Ascend, through CANN's libraries found at run time)"),
    used("npu-id", One, "mindkit: which NPU with --device npu (as `mindkit npu info` numbers them; default 0); under a launcher, rank r of a node takes --npu-id + LOCAL_RANK"),
];

/// A command-line problem.
#[derive(Debug, thiserror::Error)]
pub enum ArgsError {
    /// Not a flag mindkit knows.
    #[error("unknown flag --{0} (not a Megatron-LM / MindSpeed-LLM flag mindkit train knows; see `mindkit train --help`)")]
    Unknown(String),
    /// A value where none is taken, or none where one is needed.
    #[error("--{flag}: {why}")]
    Value {
        /// The flag.
        flag: String,
        /// What is wrong.
        why: String,
    },
    /// A flag that would change the result and is not implemented.
    #[error("--{flag} is not supported: {why}")]
    Refused {
        /// The flag.
        flag: String,
        /// Why.
        why: &'static str,
    },
    /// A stray word that is not a flag's value.
    #[error("unexpected argument {0:?} (every option is a --flag)")]
    Stray(String),
}

/// Parsed flags: name → values (empty for a flag without value).
#[derive(Debug, Clone, Default)]
pub struct Args {
    values: HashMap<&'static str, Vec<String>>,
}

fn lookup(name: &str) -> Option<&'static Flag> {
    // argparse accepts '_' and '-' only as spelled; Megatron's flags all use '-', torchrun's '_'.
    FLAGS.iter().find(|f| f.name == name)
}

impl Args {
    /// Parse `args` (without the program and subcommand).
    pub fn parse(args: &[String]) -> Result<Args, ArgsError> {
        let mut out = Args::default();
        let mut i = 0;
        while i < args.len() {
            let arg = &args[i];
            let Some(body) = arg.strip_prefix("--") else {
                return Err(ArgsError::Stray(arg.clone()));
            };
            let (name, inline) = match body.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (body, None),
            };
            let flag = lookup(name).ok_or_else(|| ArgsError::Unknown(name.to_string()))?;
            if let Effect::Refused(why) = flag.effect {
                return Err(ArgsError::Refused {
                    flag: name.to_string(),
                    why,
                });
            }
            i += 1;
            let bad = |why: &str| ArgsError::Value {
                flag: name.to_string(),
                why: why.to_string(),
            };
            let values = match (flag.takes, inline) {
                (Takes::Nothing, Some(_)) => return Err(bad("takes no value")),
                (Takes::Nothing, None) => Vec::new(),
                (_, Some(v)) => vec![v],
                (Takes::One, None) => {
                    let v = args.get(i).filter(|v| !v.starts_with("--"));
                    let v = v.ok_or_else(|| bad("needs a value"))?;
                    i += 1;
                    vec![v.clone()]
                }
                (Takes::List, None) => {
                    let start = i;
                    while i < args.len() && !args[i].starts_with("--") {
                        i += 1;
                    }
                    if i == start {
                        return Err(bad("needs at least one value"));
                    }
                    args[start..i].to_vec()
                }
            };
            out.values.insert(flag.name, values);
        }
        Ok(out)
    }

    /// Whether a flag was given.
    pub fn has(&self, name: &str) -> bool {
        self.values.contains_key(name)
    }

    /// The value of a one-value flag.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.values
            .get(name)
            .and_then(|v| v.first())
            .map(String::as_str)
    }

    /// The values of a list flag.
    pub fn list(&self, name: &str) -> Option<&[String]> {
        self.values.get(name).map(Vec::as_slice)
    }

    /// A one-value flag parsed as `T`, or an error naming the flag.
    pub fn parse_value<T: std::str::FromStr>(&self, name: &str) -> Result<Option<T>, ArgsError> {
        self.get(name)
            .map(|v| {
                v.trim().parse::<T>().map_err(|_| ArgsError::Value {
                    flag: name.to_string(),
                    why: format!("{v:?} is not a valid {}", std::any::type_name::<T>()),
                })
            })
            .transpose()
    }

    /// The flags given that have no effect here, with the reason (for the start-up log).
    pub fn inert(&self) -> Vec<(&'static str, &'static str)> {
        let mut out: Vec<(&'static str, &'static str)> = self
            .values
            .keys()
            .filter_map(|k| match lookup(k)?.effect {
                Effect::NoEffect(why) => Some((*k, why)),
                _ => None,
            })
            .collect();
        out.sort();
        out
    }
}

/// The `--help` text: every flag, grouped by what it does here.
pub fn help() -> String {
    let mut out = String::from(
        "Usage: mindkit train [MEGATRON-LM / MINDSPEED-LLM FLAGS]\n\n\
         Train a LLaMA-family model as Megatron-LM core 0.15 / MindSpeed-LLM would, on this\n\
         machine's CPU. Flags keep Megatron's and MindSpeed-LLM's names: replace\n\
         `torchrun … pretrain_gpt.py` (or posttrain_gpt.py) by `mindkit train`.\n\nUsed:\n",
    );
    let section = |out: &mut String, pick: &dyn Fn(&Effect) -> bool| {
        for f in FLAGS.iter().filter(|f| pick(&f.effect)) {
            let value = match f.takes {
                Takes::Nothing => "",
                Takes::One => " V",
                Takes::List => " V…",
            };
            out.push_str(&format!("  --{}{value}\n        {}\n", f.name, f.help));
        }
    };
    section(&mut out, &|e| *e == Effect::Used);
    out.push_str("\nAccepted, no effect here:\n");
    section(&mut out, &|e| matches!(e, Effect::NoEffect(_)));
    out.push_str("\nRefused (would change the result; not implemented):\n");
    section(&mut out, &|e| matches!(e, Effect::Refused(_)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_string).collect()
    }

    #[test]
    fn parses_as_argparse() {
        let a = Args::parse(&args(
            "--num-layers 2 --lr=1e-4 --bf16 --data-path 0.3 a 0.7 b --split 98,2,0",
        ))
        .unwrap();
        assert_eq!(a.parse_value::<usize>("num-layers").unwrap(), Some(2));
        assert_eq!(a.get("lr"), Some("1e-4"));
        assert!(a.has("bf16"));
        assert_eq!(a.list("data-path").unwrap().len(), 4);
        assert!(matches!(
            Args::parse(&args("--nope 1")),
            Err(ArgsError::Unknown(_))
        ));
        assert!(matches!(
            Args::parse(&args("--fp16")),
            Err(ArgsError::Refused { .. })
        ));
        assert!(matches!(
            Args::parse(&args("--lr")),
            Err(ArgsError::Value { .. })
        ));
        assert!(matches!(
            Args::parse(&args("--bf16=1")),
            Err(ArgsError::Value { .. })
        ));
        assert!(matches!(
            Args::parse(&args("stray")),
            Err(ArgsError::Stray(_))
        ));
        let a = Args::parse(&args("--use-flash-attn --overlap-param-gather")).unwrap();
        assert_eq!(a.inert().len(), 2);
        assert!(a.parse_value::<usize>("num-layers").unwrap().is_none());
    }

    #[test]
    fn every_flag_is_listed_once() {
        let mut names: Vec<&str> = FLAGS.iter().map(|f| f.name).collect();
        names.sort();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "a flag is listed twice");
        assert!(help().contains("--use-flash-attn"));
    }
}
