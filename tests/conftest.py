"""Shared test settings: hypothesis profiles chosen by HYPOTHESIS_PROFILE (default "ci")."""

from __future__ import annotations

import os
from typing import Callable, Optional

# Triton reads TRITON_INTERPRET when a kernel module is first imported, and not only the kernel
# tests import Triton (transformers' quantized caches import hqq, which imports triton): set it
# here, before any test module is collected, wherever no CUDA device runs the kernels.
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
except ModuleNotFoundError:  # the torch-dependent test modules skip themselves
    pass

import numpy as np  # noqa: E402
import pytest
from hypothesis import HealthCheck, settings

# Without CUDA the Triton kernels run in Triton's CPU interpreter, which has to be chosen before
# triton is first imported; transformers imports it, so a kernel test collected after a cache
# test found it too late (tests/kernels/conftest.py sets it again for a run of that folder alone).
try:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
except ModuleNotFoundError:  # no torch: the kernel tests skip themselves
    pass

settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=10, deadline=None)
settings.register_profile(
    "thorough", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def kv_like(n: int, d: int, seed: int = 0, decay: float = 0.85) -> np.ndarray:
    """Rows with a decaying spectrum in a random basis, plus one heavy channel."""
    g = np.random.default_rng(seed)
    q, _ = np.linalg.qr(g.standard_normal((d, d)))
    x = (g.standard_normal((n, d)) * decay ** np.arange(d)) @ q.T
    x[:, 0] += 3.0
    return x.astype(np.float32)


@pytest.fixture
def kv() -> np.ndarray:
    return kv_like(600, 32)


def in_forked_child(job: Callable[[], bool], timeout: float = 60.0) -> Optional[bool]:
    """Forks; the child runs `job` and reports whether it returned True (False if it raised),
    then leaves without running the parent's exit handlers. None if the child reported nothing
    within `timeout` seconds: it hung, and is killed."""
    import select
    import signal

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            ok = bool(job())
        finally:
            os.write(w, bytes([ok]))
            os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return os.read(r, 1) == b"\x01" if ready else None
    finally:
        os.close(r)


def _tiny_text(paragraphs: int = 400, seed: int = 0) -> str:
    """Paragraphs of made-up words, separated by blank lines (a stand-in corpus)."""
    g = np.random.default_rng(seed)
    words = ["".join(g.choice(list("abcdefghijklmnopqrstuvwxyz"), size=g.integers(2, 8)))
             for _ in range(300)]
    return "\n\n".join(" ".join(g.choice(words, size=g.integers(20, 60)))
                       for _ in range(paragraphs)) + "\n"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random-weight Llama and a byte-level BPE tokenizer trained on a made-up corpus, saved
    as a transformers checkpoint directory (safetensors), plus that corpus as ``text.txt``:
    what ``kakeyaturbo eval --model DIR --text FILE`` takes, built without a download."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")

    out = tmp_path_factory.mktemp("tiny-model")
    text = _tiny_text()
    (out / "text.txt").write_text(text, encoding="utf-8")
    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(text.split("\n\n"), vocab_size=320, min_frequency=2,
                            special_tokens=["<s>", "</s>"], show_progress=False)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>",
                                               eos_token="</s>")
    tok.save_pretrained(out)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    return out


class WordTokenizer:
    """A stand-in tokenizer, fast and exact: one id per whitespace-separated word (ids handed out
    as words are first seen; 0 is BOS, 1 EOS), ``decode`` joins words by spaces, and a chat
    template that marks each turn's role. Enough for the corpus, mixture and needle code."""

    bos_token_id = 0
    eos_token_id = 1
    chat_template = "{role}: {content}"

    def __init__(self) -> None:
        self.vocab = {"<s>": 0, "</s>": 1}
        self.words = ["<s>", "</s>"]

    def encode(self, text: str, add_special_tokens: bool = False) -> list:
        out = [0] if add_special_tokens else []
        for w in text.split():
            if w not in self.vocab:
                self.vocab[w] = len(self.words)
                self.words.append(w)
            out.append(self.vocab[w])
        return out

    def decode(self, ids) -> str:
        return " ".join(self.words[int(i)] for i in ids)

    def apply_chat_template(self, messages, tokenize: bool = False) -> str:
        assert not tokenize
        return "\n".join(f"<|{m['role']}|> {m['content']}" for m in messages) + "\n<|end|>"


@pytest.fixture
def word_tok() -> WordTokenizer:
    return WordTokenizer()


@pytest.fixture(scope="session")
def prose_corpus() -> None:
    """The ``prose`` domain (Debian's python3.X-doc, fetched into the cache on first use):
    skips, saying why, where this machine can neither find nor fetch it (`.ci/run` refreshes
    the package lists so that it can)."""
    from kakeyaturbo.calibration import sources

    try:
        sources.documents("prose")
    except sources.CorpusUnavailableError as e:
        pytest.skip(f"the prose corpus is not available here: {e}")
