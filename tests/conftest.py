"""Shared fixtures: the toy world, the SFT'd toy model, the real artefacts (Qwen3's tokenizer and
SmolLM2-135M-Instruct), one vLLM engine and one sandbox per session.

The SFT'd toy model takes minutes to train on a CPU, so it is built once per machine and cached
under ~/.cache/rstar2-agent (RSTAR2_TEST_CACHE overrides), keyed by the code that makes it; so are
the real artefacts. RSTAR2_TOY_WORLD, RSTAR2_TOY_MODEL and RSTAR2_REAL_ARTEFACTS point the tests
at an existing toy world / SFT'd model / output of data/prepare_real.py."""
import fcntl
import hashlib
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# One thread a process, here and in every process a test starts: pytest.ini runs two test workers on
# what may be 2 shared cores, and torch's default of a thread per core then made the toy SFT 10-30x
# slower (spinning threads wait on each other); one thread does not mind.
os.environ.setdefault("OMP_NUM_THREADS", "1")
KV_CACHE_TOKENS = 65536  # the shared engine's KV cache: 256 MB for the toy model, on any machine
CACHE = Path(os.environ.get("RSTAR2_TEST_CACHE", Path.home() / ".cache" / "rstar2-agent"))


def _run(*cmd):
    subprocess.run([sys.executable, *map(str, cmd)], cwd=ROOT, check=True)


def torchrun(nproc: int = 2) -> list[str]:
    """The command that starts nproc ranks, on a free port: the test workers run side by side, and two
    launches on torchrun's default port would meet there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1", f"--master_port={port}"]


def _cached(name: str, key_files: list[str], build) -> Path:
    """Build `name` once per key (a hash of the files that make it), atomically, under a lock."""
    import conversation  # the format is part of the key
    h = hashlib.sha256()
    for f in key_files:
        h.update((ROOT / f).read_bytes())
    h.update((conversation.render_prompt("q") + conversation.render_tool_turn("o")
              + conversation.render_tool_call("c")).encode())
    path = CACHE / f"{name}-{h.hexdigest()[:12]}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            tmp = path.with_name(path.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            build(tmp)
            tmp.rename(path)
    return path


@pytest.fixture(scope="session")
def toy_world() -> Path:
    """data/prepare_toy.py's output: train/test problems, sft.jsonl, init_model/."""
    if os.environ.get("RSTAR2_TOY_WORLD"):
        return Path(os.environ["RSTAR2_TOY_WORLD"])
    def build(out):
        _run("data/prepare_toy.py", "--out", out)
    return _cached("toy-world", ["data/prepare_toy.py"], build)


@pytest.fixture(scope="session")
def toy_sft_model(toy_world) -> Path:
    """The toy model after `sft.py --preset toy` (the starting point of RL)."""
    if os.environ.get("RSTAR2_TOY_MODEL"):
        return Path(os.environ["RSTAR2_TOY_MODEL"])
    def build(out):
        _run("sft.py", "--preset", "toy", "--model", toy_world / "init_model",
             "--data", toy_world / "sft.jsonl", "--out-dir", out)
    return _cached("toy-sft", ["data/prepare_toy.py", "sft.py"], build)


@pytest.fixture(scope="session")
def real_artefacts() -> Path:
    """data/prepare_real.py's output: qwen3-tokenizer/ and smollm2-135m-instruct/ (~30 s to build)."""
    if os.environ.get("RSTAR2_REAL_ARTEFACTS"):
        return Path(os.environ["RSTAR2_REAL_ARTEFACTS"])
    def build(out):
        _run("data/prepare_real.py", "--out", out)
    return _cached("real-artefacts", ["data/prepare_real.py"], build)


@pytest.fixture(scope="session")
def qwen3_tokenizer(real_artefacts):
    """Qwen3's real tokenizer (151,669 tokens; ChatML and tool-call special tokens)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(real_artefacts / "qwen3-tokenizer")


@pytest.fixture(scope="session")
def smollm2_model_dir(real_artefacts) -> Path:
    """SmolLM2-135M-Instruct as a plain HF folder (fp32 Llama, tied embeddings, its tokenizer inside)."""
    return real_artefacts / "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def sandbox():
    from sandbox import Sandbox
    with Sandbox(workers=2, timeout=2.0) as sb:
        yield sb


# Engines live for the whole session: vLLM 0.32 keeps its parallel groups in module globals, and an
# engine's shutdown tears them down under every other engine of the process.

@pytest.fixture(scope="session")
def toy_engine(toy_sft_model):
    """One vLLM engine on the SFT'd toy model for the whole session (an engine costs ~1 minute)."""
    from infra.engine import make_engine
    llm = make_engine(str(toy_sft_model), max_model_len=1024, seed=0, kv_cache_tokens=KV_CACHE_TOKENS)
    yield llm
    del llm


@pytest.fixture(scope="session")
def blank_toy_engine(toy_sft_model):
    """An engine on the toy model that started with random weights (vLLM's dummy load format), as
    train.py's does until its first weight sync; small, and alive for the session like the others."""
    from infra.engine import make_engine
    llm = make_engine(str(toy_sft_model), max_model_len=1024, kv_cache_tokens=8192, weights=False)
    yield llm
    del llm


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_model_dir):
    """One vLLM engine on SmolLM2 for the session, with 16K tokens of KV cache (0.7 GB)."""
    import torch
    from infra.engine import make_engine
    # One thread: with another process busy on 2 cores, two threads waiting on each other made the
    # real-model tests 5x slower. (Once an engine exists, vLLM ignores torch.set_num_threads.)
    torch.set_num_threads(1)
    llm = make_engine(str(smollm2_model_dir), max_model_len=2048, seed=0, kv_cache_tokens=16384)
    yield llm
    del llm
