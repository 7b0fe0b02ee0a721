"""``qab compare``: the same prompts through several backends, side by side.

Each prompt is run through every backend (warm-up first, then alternating the
backend order from one prompt/round block to the next), with fixed-length
greedy continuations: every backend decodes exactly ``max_tokens`` tokens, and
an end-of-sequence token is not treated specially, so speeds compare like for
like. For each backend the report gives time to first token, prefill and decode
tokens/s, the continuation, its token agreement with the reference backend
(``stock`` when present, else the first) and the first position where the two
diverge. With ``fidelity``, every backend also scores the harness's real-text
fidelity passage teacher-forced, and the report gains ``qab bench``'s
``fidelity`` section (top-1 agreement with the reference, perplexity).

Example:
    >>> from qwen_apple_backend.bench.compare import CompareConfig, run_compare
    >>> result = run_compare(CompareConfig(model="path/to/checkpoint",
    ...                                    prompts=["Hello"], max_tokens=16))
    >>> result["compare"]["prompts"][0]["backends"]["fused"]["first_divergence"]
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from .harness import (ModelSource, _fidelity, engine_flags, measure_run, open_targets,
                      progress_bar, source_tokenizer)
from .report import SCHEMA, environment, sample_stats, summarize, token_hash
from .target import parse_backend_specs

__all__ = ["CompareConfig", "format_compare", "read_prompts", "run_compare"]


@dataclass
class CompareConfig(ModelSource):
    """Settings of one ``qab compare`` run (see ``qab compare --help``)."""

    backends: Sequence[str] = ("stock", "fused")
    ablate: Sequence[str] = ()
    prompts: Sequence[str] = ()
    max_tokens: int = 32
    rounds: int = 1
    warmup: int = 1
    chat_template: bool = False
    fidelity: bool = False
    fidelity_positions: int = 256
    prefill_step_size: Optional[int] = None
    progress: bool = True
    argv: Optional[list] = None
    extra: dict = field(default_factory=dict)


def read_prompts(path: Path) -> list[str]:
    """Prompts from a file: JSON Lines with a ``"prompt"`` field, a JSON list of
    strings, or plain text with one prompt per non-empty line.

    Raises:
        ValueError: naming the file: it cannot be read (missing, a folder, not UTF-8),
            a JSON list or line is not valid JSON (with its line), or it holds no prompt.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"{path}: prompts file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read the prompts file: "
                         f"{getattr(exc, 'strerror', None) or exc}") from None
    prompts: list[str] = []
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            items = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not a valid JSON list of prompts: {exc}") from None
        prompts = [str(p) for p in items]
    else:
        for n, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line:
                continue
            if line.startswith("{"):
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}: line {n}: not valid JSON: {exc.msg}") from None
                if not isinstance(obj, dict):
                    raise ValueError(f"{path}: line {n}: a JSON line must be an object with "
                                     "a \"prompt\" field")
                prompts.append(str(obj.get("prompt", obj.get("text", ""))))
            else:
                prompts.append(line)
    prompts = [p for p in prompts if p]
    if not prompts:
        raise ValueError(f"{path}: no prompts found")
    return prompts


class _BytesTokenizer:
    """Stand-in tokenizer when none is available: UTF-8 bytes as token ids."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


def _encode(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True)
        if isinstance(ids, str):
            ids = tokenizer.encode(ids)
        return list(ids)
    return list(tokenizer.encode(prompt))


def _agreement(ref: Sequence[int], other: Sequence[int]) -> tuple[float, Optional[int]]:
    n = min(len(ref), len(other))
    first = next((i for i in range(n) if ref[i] != other[i]), None)
    if first is None and len(ref) != len(other):
        first = n
    same = sum(1 for i in range(n) if ref[i] == other[i])
    return (same / max(len(ref), len(other), 1)), first


def run_compare(cfg: CompareConfig, log: Callable[[str], None] = lambda s: None) -> dict:
    """Run every prompt through every backend; return the result document.

    Returns:
        dict: the common report frame (``schema``, ``environment``, ``model``,
        ``backends``, ``alternation``, ``summary``) plus ``compare``: per prompt, per
        backend the generated ids and text, speed, ``agreement_vs_reference`` and
        ``first_divergence`` (None when identical).

    Raises:
        ValueError: for no prompts, ``max_tokens`` < 1, or ``chat_template`` with a
            tokenizer that has no chat template.
    """
    if not cfg.prompts:
        raise ValueError("give --prompt TEXT (repeatable) or --prompts-file FILE")
    if cfg.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {cfg.max_tokens}")
    if cfg.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {cfg.rounds}")
    cfg.check()
    specs = parse_backend_specs(cfg.backends, cfg.ablate)
    env = environment(cfg.argv)
    device = env["device"]["name"]
    targets, model_info = open_targets(cfg, specs, prefill_step_size=cfg.prefill_step_size,
                                       log=log)
    labels = [t.label for t in targets]
    by_label = dict(zip(labels, targets))
    reference = "stock" if "stock" in labels else labels[0]
    vocab = min(t.vocab_size() for t in targets)

    tokenizer, tok_note = source_tokenizer(cfg, targets)
    if tokenizer is None:
        tokenizer, tok_note = _BytesTokenizer(), "utf-8 bytes (no tokenizer available)"

    if cfg.chat_template and not getattr(tokenizer, "chat_template", None):
        # It fell back to the raw text, silently, while the JSON said chat_template: true.
        raise ValueError(f"--chat-template: the tokenizer ({tok_note}) has no chat template; "
                         "leave --chat-template out to compare the raw text")
    encoded = []
    folded = False
    for p in cfg.prompts:
        ids = _encode(tokenizer, p, cfg.chat_template)
        if not ids:
            raise ValueError(f"prompt {p!r} encodes to no tokens")
        if max(ids) >= vocab:
            ids, folded = [i % vocab for i in ids], True
        encoded.append(ids)

    blocks = []
    for r in range(cfg.rounds):
        for i in range(len(encoded)):
            k = r * len(encoded) + i
            order = list(labels) if k % 2 == 0 else list(reversed(labels))
            blocks.append((r, i, order))
    sequence = [{"seq": n, "round": r, "prompt": i, "backend": b}
                for n, (r, i, b) in enumerate((r, i, b) for r, i, o in blocks for b in o)]

    n_steps = cfg.max_tokens - 1
    fid_passes = 2 * len(targets) if cfg.fidelity else 0
    bar = progress_bar(cfg.warmup * len(targets) + len(sequence) + fid_passes, cfg.progress,
                       "qab compare")
    runs: list[dict] = []
    fidelity = None
    try:
        for _ in range(cfg.warmup):
            for t in targets:
                bar.set_postfix_str(f"warm-up {t.label}")
                measure_run(t, encoded[0], n_steps)
                bar.update(1)
        for item in sequence:
            bar.set_postfix_str(f"prompt {item['prompt'] + 1} {item['backend']}")
            rec = measure_run(by_label[item["backend"]], encoded[item["prompt"]], n_steps,
                              keep_ids=True)
            rec.pop("decode_traffic", None)
            runs.append({**item, "length": len(encoded[item["prompt"]]), **rec})
            bar.update(1)
        if cfg.fidelity:
            fidelity = _fidelity(cfg, targets, vocab, bar, log)
    finally:
        bar.close()

    prompts_out = []
    for i, (text, ids) in enumerate(zip(cfg.prompts, encoded)):
        per = {}
        mine = {b: [r for r in runs if r["prompt"] == i and r["backend"] == b] for b in labels}
        ref_ids = mine[reference][0]["generated"]
        for b in labels:
            rs = mine[b]
            gen = rs[0]["generated"]
            agree, first = _agreement(ref_ids, gen)
            pre = sample_stats(len(ids), [r["prefill_s"] for r in rs])
            dec = sample_stats(max(1, n_steps), [r["decode_s"] for r in rs])
            per[b] = {
                "generated_ids": gen,
                "text": tokenizer.decode(gen),
                "ttft_s_p50": pre["seconds_p50"],
                "prefill_tokens_per_s_p50": pre["tokens_per_s_p50"],
                "decode_tokens_per_s_p50": dec["tokens_per_s_p50"] if n_steps else None,
                "peak_memory_bytes": max((r["peak_memory_bytes"] or 0) for r in rs) or None,
                "agreement_vs_reference": agree,
                "first_divergence": first,
                "deterministic_across_rounds": len({tuple(r["generated"]) for r in rs}) == 1,
            }
        prompts_out.append({"index": i, "prompt": text, "prompt_tokens": len(ids),
                            "prompt_ids_sha256": token_hash(ids), "backends": per})

    results = []
    for b in labels:
        for n in sorted({len(ids) for ids in encoded}):
            rs = [r for r in runs if r["backend"] == b and r["length"] == n]
            pre = sample_stats(n, [r["prefill_s"] for r in rs])
            pre.update(backend=b, phase="prefill", length=n, ttft_s_p50=pre["seconds_p50"])
            results.append(pre)
            if n_steps:
                dec = sample_stats(n_steps, [r["decode_s"] for r in rs])
                dec.update(backend=b, phase="decode", length=n, decode_tokens=n_steps)
                results.append(dec)
    for r in runs:
        r.pop("generated", None)
    summary = summarize(results, device, baseline=reference)
    return {
        "schema": SCHEMA,
        "kind": "compare",
        "environment": env,
        "device": device,
        "model": model_info,
        "settings": {**{k: v for k, v in asdict(cfg).items()
                        if k not in ("argv", "extra", "prompts")},
                     "batch_size": 1, "sampling": "greedy (argmax), fixed length",
                     "prefill_step_size": min(getattr(t, "prefill_step_size", 0) or 0
                                              for t in targets) or None,
                     "reference": reference, "tokenizer": tok_note,
                     "token_ids_folded_mod": vocab if folded else None},
        "engine_flags": engine_flags(),
        "backends": [{**spec.to_dict(), "describe": t.describe()}
                     for spec, t in zip(specs, targets)],
        "prompt": {"token_ids_sha256": token_hash([i for ids in encoded for i in ids])},
        "alternation": {"order_per_block": [o for _, _, o in blocks], "sequence": sequence},
        "runs": runs,
        "results": results,
        "compare": {"reference": reference, "max_tokens": cfg.max_tokens,
                    "prompts": prompts_out},
        "fidelity": fidelity,
        "summary": summary,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _clip(text: str, width: int) -> str:
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 3] + "..."


def format_compare(result: dict, width: int = 100) -> str:
    """Side-by-side text of a :func:`run_compare` result."""
    cmp = result["compare"]
    ref = cmp["reference"]
    lines = []
    for p in cmp["prompts"]:
        lines.append(f"[{p['index'] + 1}] {_clip(p['prompt'], width - 8)!r} "
                     f"({p['prompt_tokens']} prompt tokens, {cmp['max_tokens']} generated)")
        head = (f"  {'backend':<16} {'TTFT ms':>8} {'prefill tok/s':>13} {'decode tok/s':>12} "
                f"{'agree vs ' + ref:>15} {'first divergence':>16}")
        lines.append(head)
        for b, r in p["backends"].items():
            dec = r["decode_tokens_per_s_p50"]
            div = r["first_divergence"]
            agree = "(reference)" if b == ref else f"{100 * r['agreement_vs_reference']:.1f}%"
            where = "-" if b == ref else ("none" if div is None else str(div))
            speed = f"{dec:.1f}" if dec else "-"
            lines.append(
                f"  {b:<16} {r['ttft_s_p50'] * 1e3:>8.1f} {r['prefill_tokens_per_s_p50']:>13.1f} "
                f"{speed:>12} {agree:>15} {where:>16}")
        for b, r in p["backends"].items():
            lines.append(f"    {b:<14} | {_clip(r['text'], width - 20)}")
        lines.append("")
    return "\n".join(lines)
