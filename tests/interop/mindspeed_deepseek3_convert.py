"""Run MindSpeed-LLM's own DeepSeek-V3 converter (examples/mcore/deepseek3/convert_ckpt_deepseek3.py
of a checkout) on a small HF DeepSeek-V3 directory. The script fixes DeepSeek-V3-671B's shape in
module constants; they are set from config.json before it runs (the MTP layers, at
num_hidden_layers, from num_nextn_predict_layers), and the one-file safetensors directory is
given the index the script reads.

    python mindspeed_deepseek3_convert.py MINDSPEED_LLM HF_DIR OUT TP EP [--mla-mm-split] [--dualpipev]

--dualpipev: two pipeline stages in DualPipeV's V (its --pp 2 --schedules-method dualpipev).
"""
import importlib.util
import json
import shutil
import sys
from pathlib import Path

from safetensors import safe_open

msllm, src, out, tp, ep = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), *map(int, sys.argv[4:6])
mm_split = "--mla-mm-split" in sys.argv[6:]
dualpipev = "--dualpipev" in sys.argv[6:]
hf = out / "hf"
shutil.copytree(src, hf)
cfg = json.loads((hf / "config.json").read_text())
with safe_open(hf / "model.safetensors", "pt") as f:
    names = list(f.keys())
(hf / "model.safetensors.index.json").write_text(
    json.dumps({"weight_map": {n: "model.safetensors" for n in names}}))
path = Path(msllm) / "examples/mcore/deepseek3/convert_ckpt_deepseek3.py"
spec = importlib.util.spec_from_file_location("convert_ckpt_deepseek3", path)
conv = importlib.util.module_from_spec(spec)
spec.loader.exec_module(conv)
conv.HIDDEN_SIZE = cfg["hidden_size"]
conv.NUM_EXPERTS = cfg["n_routed_experts"]
conv.NUM_ATTENTION_HEADS = cfg["num_attention_heads"]
conv.QK_HEAD_DIM = cfg["qk_nope_head_dim"]
conv.QK_POS_EMB_HEAD_DIM = cfg["qk_rope_head_dim"]
conv.V_HEAD_DIM = cfg["v_head_dim"]
conv.FIRST_K_DENSE_REPLACE = cfg["first_k_dense_replace"]
conv.MTP_LAYER_INDEX = cfg["num_hidden_layers"]
conv.CkptConvert(hf_model_path=str(hf), mg_save_path=str(out / "mg"),
                 num_layers=cfg["num_hidden_layers"], tp_size=tp, ep_size=ep,
                 pp_size=2 if dualpipev else 1, dualpipe="dualpipev" if dualpipev else None,
                 num_dense_layers=cfg["first_k_dense_replace"],
                 mtp_num_layers=cfg.get("num_nextn_predict_layers", 0), mla_mm_split=mm_split).run()
