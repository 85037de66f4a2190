"""Builds megatron-core 0.15's GPTDataset indices (document, sample and shuffle) for the train split
of PREFIX as pretrain_gpt.py does (without --data-cache-path they are cached in PREFIX's directory,
under PREFIX/cache/, and loaded from there the next time), and prints the seconds it took.
Usage: gpt_indices.py PREFIX SEQ SAMPLES"""
import sys
import time

sys.path.insert(0, "tests/interop")
import megatron_cpu  # noqa: E402

prefix, seq, samples = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
megatron_cpu.init()
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig  # noqa: E402


class Tokenizer:
    eod = 0
    pad = -1
    unique_identifiers = {"class": "MindkitBenchTokenizer"}


start = time.perf_counter()
config = GPTDatasetConfig(random_seed=1234, sequence_length=seq, blend=([prefix], None), split="969,30,1",
                          path_to_cache=None, reset_position_ids=False, reset_attention_mask=False,
                          eod_mask_loss=False, tokenizer=Tokenizer())
train = BlendedMegatronDatasetBuilder(GPTDataset, [samples, 0, 0], lambda: True, config).build()[0]
print(f"{len(train)} samples in {time.perf_counter() - start:.2f} s", file=sys.stderr)
