"""A real-size byte-level BPE tokenizer, trained locally on the Python standard library's own sources.

No hub is reachable, so the real architectures (`trainer.model_shapes`) get a tokenizer made here. The
corpus is the running interpreter's standard library (.py files, sorted, up to a byte budget): it is on
every machine that runs the project, CI included, with no download. Byte-level BPE represents every byte,
so there is no unknown token; the merges give multi-character tokens (code and English docstrings).

The vocabulary is padded to the architecture's size (151,936 or 128,256) as the real ones are: after the
learned tokens come the ChatML special tokens, then `<|reserved_N|>` ids, so every id the model's
embedding has decodes to something (a random model samples all of them). The reserved ids are plain vocab
entries no merge produces, not added tokens: ~120k added tokens made loading the tokenizer take ~4 s
(0.5 s this way), and every worker, verifier and trainer loads it.

Training takes ~3 s on 2 cores for the whole standard library (~12 MB); the trained BPE is cached by its
inputs (corpus digest, vocabulary size, tokenizers version), so repeated calls and tests train it once.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

CORPUS_NAME = "python-stdlib"
CORPUS_BUDGET = 16 << 20  # bytes; the whole 3.11 standard library (~12 MB without tests) fits
BPE_VOCAB = 32768  # 256 bytes + ~32.5k merges: what ~12 MB of text supports with min_frequency 2
FORMAT = 1  # bump when the construction below changes: it is part of the cache key
ENDOFTEXT, IM_START, IM_END, PAD = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, PAD)
# GPT-style split before byte-level BPE: words, single digits (as Qwen), punctuation runs, whitespace.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# ChatML, with no default system message (the orchestrator adds its own system prompt when configured).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Not corpus text: tests are large and odd (encodings, binary blobs); _sysconfigdata holds this machine's
# build paths, which would make the tokenizer differ between two machines with the same Python.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass
class Corpus:
    texts: list[str]  # one per file, in sorted path order
    digest: str  # sha256 over (relative path, bytes) of the files read
    n_bytes: int
    n_files: int
    root: str
    name: str = CORPUS_NAME
    budget: int = CORPUS_BUDGET

    def info(self) -> dict:
        return {"name": self.name, "root": self.root, "files": self.n_files, "bytes": self.n_bytes,
            "budget": self.budget, "sha256": self.digest}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path) -> list[Path]:
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts[:-1]) or p.name.startswith("_sysconfigdata"):
            continue
        files.append(p)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def read_corpus(root: Path | None = None, budget: int = CORPUS_BUDGET) -> Corpus:
    """The corpus files in sorted order, stopping before the first that would pass `budget` bytes."""
    root = Path(root) if root is not None else stdlib_root()
    h = hashlib.sha256()
    texts, n = [], 0
    for p in corpus_files(root):
        data = p.read_bytes()
        if n + len(data) > budget:
            break
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + len(data).to_bytes(8, "little"))
        h.update(data)
        texts.append(data.decode("utf-8", errors="replace"))
        n += len(data)
    if not texts:
        raise ValueError(f"no corpus text under {root} within {budget} bytes")
    return Corpus(texts, h.hexdigest(), n, len(texts), str(root), budget=budget)


def default_cache_dir() -> Path:
    base = os.environ.get("SWARMRL_CACHE_DIR") or os.path.join(os.environ.get("XDG_CACHE_HOME")
        or os.path.expanduser("~/.cache"), "swarmrl")
    return Path(base) / "tokenizers"


def _cache_key(corpus: Corpus, bpe_vocab: int) -> str:
    import tokenizers

    parts = {"format": FORMAT, "corpus": corpus.digest, "bpe_vocab": bpe_vocab, "split": SPLIT_PATTERN,
        "tokenizers": tokenizers.__version__}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


def train_bpe(corpus: Corpus, bpe_vocab: int = BPE_VOCAB) -> str:
    """The trained tokenizer's JSON (no special tokens yet). Deterministic: checked byte for byte across
    processes, with tokenizers' parallelism on and off."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab, min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
        show_progress=False
    )
    tok.train_from_iterator(corpus.texts, trainer)
    return tok.to_str()


def trained_bpe(corpus: Corpus, bpe_vocab: int = BPE_VOCAB, cache_dir: Path | None = None) -> tuple[str, bool]:
    """The trained tokenizer's JSON from the cache, or trained and cached. Returns (json, cache hit)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = cache_dir / f"bpe-{_cache_key(corpus, bpe_vocab)}.json"
    if path.is_file():
        return path.read_text(encoding="utf-8"), True
    text = train_bpe(corpus, bpe_vocab)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # atomic: two processes may train at once
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return text, False


def pad_vocabulary(trained: str, vocab_size: int) -> str:
    """The trained tokenizer with the special tokens after the learned ones and reserved ids up to `vocab_size`."""
    d = json.loads(trained)
    vocab: dict[str, int] = d["model"]["vocab"]
    n = len(vocab)
    if sorted(vocab.values()) != list(range(n)):
        raise ValueError("the trained vocabulary is not contiguous")
    if vocab_size < n + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the {n} learned tokens and {len(SPECIAL_TOKENS)} "
            f"special tokens")
    added = []
    for i, s in enumerate(SPECIAL_TOKENS):
        vocab[s] = n + i
        added.append({"id": n + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True})
    first = n + len(SPECIAL_TOKENS)
    for k, i in enumerate(range(first, vocab_size)):
        vocab[f"<|reserved_{k}|>"] = i  # no merge makes these strings: never produced by encoding
    d["added_tokens"] = added
    return json.dumps(d, ensure_ascii=False)


@dataclass
class BuiltTokenizer:
    tokenizer: object  # transformers.PreTrainedTokenizerFast
    info: dict = field(default_factory=dict)


def build_tokenizer(vocab_size: int, bpe_vocab: int = BPE_VOCAB, cache_dir: Path | None = None,
                    corpus: Corpus | None = None, model_max_length: int = 32768) -> BuiltTokenizer:
    """A PreTrainedTokenizerFast of exactly `vocab_size` ids: EOS `<|im_end|>`, pad `<|pad|>`, no BOS (as Qwen),
    a ChatML chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    corpus = corpus or read_corpus()
    trained, hit = trained_bpe(corpus, bpe_vocab, cache_dir)
    learned = len(json.loads(trained)["model"]["vocab"])
    padded = pad_vocabulary(trained, vocab_size)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(padded),
        eos_token=IM_END,
        pad_token=PAD,
        bos_token=None,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )
    if len(tok) != vocab_size:
        raise AssertionError(f"tokenizer has {len(tok)} ids, not {vocab_size}")
    info = {
        "kind": "byte-level BPE",
        "corpus": corpus.info(),
        "bpe_vocab_target": bpe_vocab,
        "learned_tokens": learned,
        "merges": len(json.loads(trained)["model"]["merges"]),
        "special_tokens": {s: tok.convert_tokens_to_ids(s) for s in SPECIAL_TOKENS},
        "reserved_tokens": vocab_size - learned - len(SPECIAL_TOKENS),
        "vocab_size": vocab_size,
        "cache_hit": hit,
    }
    return BuiltTokenizer(tok, info)
