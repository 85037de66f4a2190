"""Run Megatron-LM's own checkpointing code (megatron.training.checkpointing, from the source tree
on PYTHONPATH) on a checkpoint directory; print what it read as one JSON line."""
import argparse
import json
import sys

from megatron.training import checkpointing as C

FIELDS = ["num_layers", "hidden_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
          "virtual_pipeline_model_parallel_size", "padded_vocab_size", "num_query_groups",
          "add_qkv_bias"]
READ = FIELDS + [
    "ffn_hidden_size", "seq_length", "num_attention_heads", "group_query_attention", "kv_channels",
    "max_position_embeddings", "position_embedding_type", "add_position_embedding",
    "use_rotary_position_embeddings", "rotary_base", "rotary_percent", "rotary_interleaved",
    "add_bias_linear", "swiglu", "untie_embeddings_and_output_weights", "apply_layernorm_1p",
    "normalization", "tokenizer_type", "num_layers_per_virtual_pipeline_stage",
    "expert_model_parallel_size"]

d = sys.argv[1]
iteration, release = C.read_metadata(C.get_checkpoint_tracker_filename(d))
assert C.find_checkpoint_rank_0(d, iteration, release), "rank 0 not found"
args = argparse.Namespace(
    load=d, non_persistent_global_ckpt_dir=None, ckpt_step=None, exit_on_missing_checkpoint=True,
    ckpt_format="torch", auto_detect_ckpt_format=True, use_tokenizer_model_from_checkpoint_args=True,
    use_mp_args_from_checkpoint_args=True, non_persistent_ckpt_type=None,
    retro_add_retriever=False, **{k: None for k in READ})
args, _ = C.load_args_from_checkpoint(args)
print(json.dumps({"iteration": iteration, "release": release,
                  **{k: getattr(args, k) for k in FIELDS}}))
