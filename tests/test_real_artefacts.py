"""The real artefacts of data/prepare_real.py: Qwen3's tokenizer and SmolLM2-135M-Instruct as HF folders.

They are what the other tests load as a real tokenizer and a real pretrained model, so these guard
that they are what they claim: the known Qwen3 ids, a plain fp32 Llama that loads without the GGUF
and answers like the pretrained model, and a build that is done once."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "<|im_start|>user\nWhat is 17*23?<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def smollm2(smollm2_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.set_num_threads(1)  # as in conftest._run: with anything else running, 2 made generate 10x slower
    model = AutoModelForCausalLM.from_pretrained(smollm2_model_dir).eval()  # no gguf_file: as vLLM loads it
    return model, AutoTokenizer.from_pretrained(smollm2_model_dir)


def greedy(smollm2, text: str, n_tokens: int) -> str:
    model, tokenizer = smollm2
    ids = torch.tensor([tokenizer.encode(text)])  # (1, T)
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n_tokens, do_sample=False)  # (1, T + new)
    return tokenizer.decode(out[0, ids.shape[1]:])


def test_qwen3_tokenizer_has_the_known_ids(qwen3_tokenizer):
    assert qwen3_tokenizer.encode("Hello, world!") == [9707, 11, 1879, 0], "not Qwen3's BPE"
    specials = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657,
                "</tool_call>": 151658, "<tool_response>": 151665, "</tool_response>": 151666}
    for token, id_ in specials.items():
        assert qwen3_tokenizer.encode(token) == [id_], f"{token} is not one special token with Qwen3's id"
    assert qwen3_tokenizer.eos_token == "<|im_end|>", "Qwen3's turns end with <|im_end|>"


def test_smollm2_is_a_plain_fp32_llama_without_the_gguf(smollm2, smollm2_model_dir):
    config = json.loads((smollm2_model_dir / "config.json").read_text())
    assert "quantization_config" not in config, "a GGUF quantization_config sends every load to the GGUF"
    assert config["model_type"] == "llama" and config["tie_word_embeddings"]
    assert config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    model, tokenizer = smollm2
    assert model.dtype == torch.float32 and len(tokenizer) == 49152
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(), "untied embeddings"
    assert (tokenizer.eos_token_id, model.generation_config.eos_token_id) == (2, 2), "eos must be <|im_end|>"


def test_smollm2_answers_like_the_pretrained_model(smollm2):
    # Greedy, it gets 17*23 (= 391) wrong, as a tiny pretrained model does. It says 340 here, but from
    # logits 0.01 apart, so only the start is pinned.
    text = greedy(smollm2, PROMPT, 10)
    assert text.startswith("17*23 = 3") and "391" not in text, f"greedy answer {text!r}"
    # The saved chat template adds SmolLM2's default system prompt; then it answers and ends its turn
    tokenizer = smollm2[1]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 17*23?"}],
                                         add_generation_prompt=True, tokenize=False)
    assert chat.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM"), chat
    assert chat.endswith(PROMPT), chat
    assert greedy(smollm2, chat, 16) == "17*23 = 381.<|im_end|>", "the chat template or eos was lost"


def test_prepare_real_leaves_a_finished_folder_as_it_is(real_artefacts):
    assert (real_artefacts / "DONE").exists(), f"{real_artefacts}: not a finished data/prepare_real.py output"
    before = {p: p.stat().st_mtime_ns for p in real_artefacts.rglob("*")}
    start = time.time()
    proc = subprocess.run([sys.executable, "data/prepare_real.py", "--out", str(real_artefacts)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0 and "already built" in proc.stdout, proc.stdout + proc.stderr
    assert time.time() - start < 10, "a finished folder must cost no download, import or conversion"
    after = {p: p.stat().st_mtime_ns for p in real_artefacts.rglob("*")}
    assert after == before, "the second run wrote files"
