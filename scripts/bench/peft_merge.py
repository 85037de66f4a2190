"""The peer of `mindkit lora merge`: peft loads the base (bf16, as stored) and the adapter,
merge_and_unload(), save_pretrained. Usage: peft_merge.py BASE ADAPTER OUT"""
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

torch.set_num_threads(2)
base = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16)
PeftModel.from_pretrained(base, sys.argv[2]).merge_and_unload().save_pretrained(sys.argv[3])
