"""The benchmark harness (``qab bench`` / ``qab compare``) on the CPU with a tiny model.

No timing assertions: these tests check that the harness runs end to end, writes
every field the result format promises, alternates backends as recorded, and that
its fidelity and agreement numbers are exact where they must be.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from qwen_apple_backend.bench import harness, report
from qwen_apple_backend.bench.compare import _agreement
from qwen_apple_backend.bench.target import (BackendSpec, BenchTarget, MLXTarget,
                                             cache_read_bytes, parse_backend_specs,
                                             weight_read_bytes)
from qwen_apple_backend.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _json_files(folder, pattern):
    files = sorted(folder.glob(pattern))
    assert len(files) == 1, f"expected one {pattern} in {folder}, found {files}"
    return files[0]


@pytest.fixture(scope="module")
def bench_run(tiny_hf_f32, tmp_path_factory):
    """One ``qab bench --quick`` run with an ablation, two rounds so the order flips."""
    out = tmp_path_factory.mktemp("bench-out")
    argv = ["bench", "--model", str(tiny_hf_f32), "--quick", "--rounds", "2",
            "--decode-tokens", "4", "--ablate", "moe", "--fidelity-positions", "192",
            "--bandwidth-mib", "16", "--out", str(out), "--tag", "test", "--no-progress"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = main(argv)
    return rc, out, printed.getvalue()


def test_bench_quick_writes_valid_json_with_every_field(bench_run):
    rc, out, printed = bench_run
    assert rc == 0
    path = _json_files(out, "bench-*-test.json")
    text = path.read_text(encoding="utf-8")
    assert "NaN" not in text and "Infinity" not in text  # strict JSON
    result = json.loads(text)

    assert result["schema"] == report.SCHEMA and result["kind"] == "bench"
    env = result["environment"]
    assert env["device"]["name"] and result["device"] == env["device"]["name"]
    for key in ("mlx", "mlx_lm", "qwen_apple_backend"):
        assert env["versions"][key], key
    assert "git" in env  # None outside a checkout
    assert env["command_line"].startswith("qab bench") and "--quick" in env["command_line"]

    model = result["model"]
    assert model["source"] == "path" and model["path"].endswith("tiny-hf-f32")
    assert len(model["config_sha256"]) == 64 and len(model["weight_index_sha256"]) == 64

    settings = result["settings"]
    assert settings["batch_size"] == 1
    assert settings["prefill_step_size"] == 2048
    assert settings["lengths"] == harness.QUICK_LENGTHS and settings["rounds"] == 2
    assert len(result["prompt"]["token_ids_sha256"]) == 64
    assert set(result["engine_flags"]) >= {"QAB_DISABLE", "QAB_ENABLE", "QAB_DISABLE_KERNELS"}

    labels = [b["label"] for b in result["backends"]]
    assert labels == ["stock", "fused", "fused-no-moe"]
    for b in result["backends"]:
        d = b["describe"]
        assert d["dtype"] == "float32" and d["prefill_step_size"] == 2048
        assert "quantization" in d and d["kind"] == "mlx"

    summary = result["summary"]
    assert len(summary) == len(labels) * 2 * len(harness.QUICK_LENGTHS)
    for rec in summary:
        for key in report.SUMMARY_FIELDS:
            assert key in rec, key
        assert rec["phase"] in ("prefill", "decode")
        assert rec["tokens_per_s_p50"] > 0 and rec["tokens_per_s_p95"] > 0
        assert rec["device"] == result["device"]
        if rec["backend"] == "stock":
            assert rec["ratio_vs_stock"] == 1.0
        else:
            assert rec["ratio_vs_stock"] > 0
            assert rec["verdict"] in ("faster", "slower", "no difference")
    for rec in result["results"]:
        assert rec["n"] == 2 and len(rec["samples_s"]) == 2  # raw samples kept
        if rec["phase"] == "decode":
            assert rec["bytes_per_token"]["total"] > 0
            assert rec["bytes_per_token"]["kv_cache"] > 0
            assert rec["bytes_per_token"]["recurrent_state"] > 0
            assert rec["roofline_pct"] > 0
        else:
            assert rec["ttft_s_p50"] > 0
    assert result["bandwidth"]["source"] == "measured" and result["bandwidth"]["gbs"] > 0
    for run in result["runs"]:
        assert run["peak_memory_bytes"] > 0

    assert "vs stock" in printed and "fused-no-moe" in printed and "fidelity" in printed


def test_bench_alternation_recorded_and_alternating(bench_run):
    _, out, _ = bench_run
    result = json.loads(_json_files(out, "bench-*-test.json").read_text())
    alt = result["alternation"]
    labels = ["stock", "fused", "fused-no-moe"]
    assert alt["order_per_round"] == [labels, labels[::-1]]
    seq = alt["sequence"]
    assert [s["seq"] for s in seq] == list(range(len(seq)))
    # Within a round, every length runs the round's order: A B C A B C ...
    for r, order in enumerate(alt["order_per_round"]):
        backends = [s["backend"] for s in seq if s["round"] == r]
        assert backends == order * len(harness.QUICK_LENGTHS)
        assert all(a != b for a, b in zip(backends, backends[1:]))
    # The measured runs follow the recorded sequence.
    assert [(r["seq"], r["backend"], r["length"]) for r in result["runs"]] == [
        (s["seq"], s["backend"], s["length"]) for s in seq]


def test_bench_png_is_a_real_image(bench_run):
    import matplotlib.image

    _, out, _ = bench_run
    png = _json_files(out, "bench-*-test.png")
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    img = matplotlib.image.imread(png)
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400


def test_bench_fidelity_and_ablation_labels(bench_run):
    _, out, _ = bench_run
    result = json.loads(_json_files(out, "bench-*-test.json").read_text())
    fid = result["fidelity"]
    assert fid["positions"] >= 192 and fid["meets_min_positions"]
    assert fid["baseline"] == "stock"
    assert set(fid["backends"]) == {"stock", "fused", "fused-no-moe"}
    # A backend against itself agrees exactly, and every backend is deterministic.
    assert fid["backends"]["stock"]["agreement_vs_stock"] == 1.0
    for rec in fid["backends"].values():
        assert rec["self_agreement"] == 1.0
        assert math.isfinite(rec["perplexity"]) and rec["perplexity"] > 1
    ablation = next(b for b in result["backends"] if b["label"] == "fused-no-moe")
    assert ablation["backend"] == "fused" and ablation["ablation"] == "moe"
    assert ablation["disable"] == ["moe"]
    counts = ablation["describe"]["fused_counts"]
    assert counts["moe"][0] == 0 and counts["gdn"][0] == counts["gdn"][1] > 0
    fused = next(b for b in result["backends"] if b["label"] == "fused")
    assert fused["describe"]["fused_counts"]["moe"][0] > 0


def test_compare_chat_template_without_one_is_an_error(tmp_path, capsys):
    # It compared the raw text, silently, while the JSON said chat_template: true.
    from ._llama import write_tiny_llama

    model = write_tiny_llama(tmp_path / "llama")
    rc = main(["compare", "--model", str(model), "--prompt", "w1 w2", "--max-tokens", "2",
               "--chat-template", "--no-progress"])
    assert rc == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "qab compare: error: --chat-template: the tokenizer (from the checkpoint) has no chat "
        "template; leave --chat-template out to compare the raw text")


def test_compare_prints_first_divergence_and_writes_json(tiny_hf_f32, tmp_path, capsys):
    out = tmp_path / "compare.json"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The lighthouse keeper wrote\n\nA careful habit, kept long enough,\n")
    rc = main(["compare", "--model", str(tiny_hf_f32), "--backends", "stock,fused",
               "--prompt", "Hello there", "--prompts-file", str(prompts), "--max-tokens", "6",
               "--json", str(out), "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "first divergence" in printed and "(reference)" in printed
    result = json.loads(out.read_text())
    assert result["kind"] == "compare" and result["compare"]["reference"] == "stock"
    assert len(result["compare"]["prompts"]) == 3
    for p in result["compare"]["prompts"]:
        for label in ("stock", "fused"):
            rec = p["backends"][label]
            assert "first_divergence" in rec and len(rec["generated_ids"]) == 6
        assert p["backends"]["stock"]["first_divergence"] is None
        assert p["backends"]["stock"]["agreement_vs_reference"] == 1.0
    for rec in result["summary"]:
        for key in report.SUMMARY_FIELDS:
            assert key in rec
    assert result["alternation"]["order_per_block"][:2] == [["stock", "fused"],
                                                            ["fused", "stock"]]


def test_agreement_and_first_divergence():
    assert _agreement([1, 2, 3, 4], [1, 2, 3, 4]) == (1.0, None)
    assert _agreement([1, 2, 3, 4], [1, 9, 3, 4]) == (0.75, 1)
    assert _agreement([1, 2], [1, 2, 3]) == (2 / 3, 2)


def test_fidelity_of_a_model_with_itself_is_exact(tiny_hf_f32):
    from qwen_apple_backend.bench.fidelity import FIDELITY_TEXT, fidelity_ids, run_fidelity
    from qwen_apple_backend.loader import load_model

    model, _, _ = load_model(tiny_hf_f32, "stock")
    a = MLXTarget(model, label="stock")
    b = MLXTarget(model, label="copy")
    assert isinstance(a, BenchTarget)
    ids, info = fidelity_ids(None, a.vocab_size(), positions=192)
    assert info["tokenizer"].startswith("utf-8 bytes") and len(ids) == 193
    assert len(FIDELITY_TEXT.encode()) > 193
    out = run_fidelity([a, b], ids)
    assert out["positions"] == 192
    assert out["backends"]["copy"]["agreement_vs_stock"] == 1.0
    assert out["backends"]["copy"]["first_disagreement"] is None
    assert out["backends"]["copy"]["logits_max_abs_diff_vs_stock"] == 0.0


def test_mlx_target_prefill_decode_matches_teacher_forcing(tiny_hf_f32):
    from qwen_apple_backend.loader import load_model

    model, _, _ = load_model(tiny_hf_f32, "fused")
    t = MLXTarget(model, label="fused", prefill_step_size=5)  # several prefill chunks
    prompt = list(range(3, 20))
    first = t.prefill(prompt)
    small = t.decode_traffic()
    rest = t.decode(5)
    greedy = [first, *rest]
    # Feeding the greedy continuation back teacher-forced reproduces it.
    logits = t.logits(prompt + greedy[:-1])
    assert logits.dtype == np.float32 and logits.shape == (len(prompt) + 5, t.vocab_size())
    assert logits[len(prompt) - 1:].argmax(-1).tolist() == greedy
    t.reset()
    t.prefill(list(range(3, 60)))
    large = t.decode_traffic()
    assert large["kv_cache"] > small["kv_cache"]  # KV reads grow with context
    assert large["recurrent_state"] == small["recurrent_state"] > 0  # fixed-size state
    assert t.peak_memory() > 0


def test_weight_read_bytes_counts_top_k_of_experts(tiny_hf_f32):
    from qwen_apple_backend.loader import load_model

    model, config, _ = load_model(tiny_hf_f32, "stock")
    w = weight_read_bytes(model)
    tc = config.get("text_config", config)
    k, e = tc["num_experts_per_tok"], tc["num_experts"]
    assert w["experts_total"] > 0
    assert abs(w["experts_active"] - w["experts_total"] * k / e) <= 8
    assert w["lm_head"] > 0 and 0 < w["embedding_row"] < w["lm_head"]
    assert w["attention"] > 0 and w["gdn"] > 0 and w["shared_expert"] > 0
    assert cache_read_bytes([]) == {"kv_cache": 0, "recurrent_state": 0}


def test_parse_lengths_and_specs():
    assert harness.parse_lengths("4k,256,1K,256") == [256, 1024, 4096]
    assert harness.parse_lengths("128K") == [131072]
    with pytest.raises(ValueError):
        harness.parse_lengths("abc")
    with pytest.raises(ValueError):
        harness.parse_lengths("")
    assert harness.parse_lengths("1.5K") == [1536]
    for bad, message in (("4K,", "empty entry"), ("4K,,8K", "empty entry"),
                         ("inf", "'inf' is not a length"), ("1e400", "'1e400' is not a length"),
                         ("2.5", "'2.5' is not a whole number"), ("4Kk", "'4Kk' is not a length")):
        with pytest.raises(ValueError, match=message):
            harness.parse_lengths(bad)
    specs = parse_backend_specs("stock,fused", "moe,attn")
    assert [s.label for s in specs] == ["stock", "fused", "fused-no-moe", "fused-no-attn"]
    assert specs[2] == BackendSpec("fused-no-moe", "fused", frozenset({"moe"}), "moe")
    # Any case, as QAB_DISABLE reads it.
    assert parse_backend_specs("stock,fused", " MOE,Attn ") == specs
    with pytest.raises(ValueError, match="'moe' listed more than once"):
        parse_backend_specs("stock,fused", "moe,MOE")
    with pytest.raises(ValueError):
        parse_backend_specs("stock,fused", "mlp")
    with pytest.raises(ValueError):
        parse_backend_specs("stock,stock")
    # "fused=" (an unset "fused=$GGUF") measured --model / --preset in that column.
    with pytest.raises(ValueError, match=r"^--backends: 'fused=' has no path after '=' "
                                         r"\(NAME=PATH gives a backend its own model; NAME "
                                         r"alone uses --model / --preset\)$"):
        parse_backend_specs("stock,fused=")


def test_an_ablation_column_keeps_what_qab_disable_switched_off(monkeypatch):
    # The ablated column is the fused column minus one switch: a disable=
    # list replaces QAB_DISABLE at load time, so the spec carries both.
    monkeypatch.setenv("QAB_DISABLE", "proj-gemv")
    specs = parse_backend_specs("stock,fused", "norm-proj")
    assert specs[2].disable == frozenset({"proj-gemv", "norm-proj"})
    assert specs[1].disable == frozenset()  # fused loads with the variable itself
    with pytest.raises(ValueError, match=r"^--ablate: 'proj-gemv' is already switched off by "
                                         r"QAB_DISABLE, so fused-no-proj-gemv would measure "
                                         r"fused again$"):
        parse_backend_specs("stock,fused", "norm-proj,proj-gemv")
    monkeypatch.delenv("QAB_DISABLE")
    assert parse_backend_specs("fused", "moe")[1].disable == frozenset({"moe"})


def test_schedule_warmup_and_statistics():
    orders, seq = harness.alternation_schedule(["a", "b"], [1, 2], 3)
    assert orders == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert [s["backend"] for s in seq[:4]] == ["a", "b", "a", "b"]
    assert [s["backend"] for s in seq[4:8]] == ["b", "a", "b", "a"]
    # A shortened warm-up keeps the length of the last partial prefill chunk.
    for n in (5000, 8192, 131072, 4097):
        w = harness.warmup_length(n, 2048, 4096)
        assert w <= 4096 and (w - 1) % 2048 == (n - 1) % 2048
    assert harness.warmup_length(300, 2048, 4096) == 300

    s = report.sample_stats(100, [1.0, 1.1, 0.9, 1.0, 2.0])
    assert s["tokens_per_s_p50"] == pytest.approx(100.0)
    assert s["tokens_per_s_p95"] < s["tokens_per_s_p50"]
    assert s["samples_s"] == [1.0, 1.1, 0.9, 1.0, 2.0]
    assert report.verdict(1.03, 0.05, 0.02, 5, 5) == "no difference"
    assert report.verdict(1.30, 0.05, 0.02, 5, 5) == "faster"
    assert report.verdict(0.70, 0.05, 0.02, 5, 5) == "slower"
    assert report.verdict(1.30, 0.0, 0.0, 1, 1) == "single sample"


# ---- a non-MLX backend plugs into the harness through bench_target -------------------------

class _Tok:
    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


class FakeTarget:
    """A pure-Python target: next token = previous + 1 (no MLX anywhere)."""

    kind = "fake"

    def __init__(self, label, vocab=1024):
        self.label, self.vocab, self.tokenizer = label, vocab, _Tok()
        self.last = None
        self.peak = 0

    def reset(self):
        self.last = None

    def prefill(self, ids):
        self.last = (ids[-1] + 1) % self.vocab
        self.peak = max(self.peak, len(ids))
        return self.last

    def decode(self, n):
        out = []
        for _ in range(n):
            self.last = (self.last + 1) % self.vocab
            out.append(self.last)
        return out

    def logits(self, ids):
        x = np.zeros((len(ids), self.vocab), dtype=np.float32)
        x[np.arange(len(ids)), (np.asarray(ids) + 1) % self.vocab] = 1.0
        return x

    def synchronize(self):
        pass

    def peak_memory(self):
        return self.peak

    def reset_peak_memory(self):
        self.peak = 0

    def active_memory(self):
        return None

    def decode_traffic(self):
        return None

    def vocab_size(self):
        return self.vocab

    def describe(self):
        return {"label": self.label, "kind": self.kind}


class FakeBackend:
    name = "fake"

    def available(self):
        return True, ""

    def load(self, path, **kwargs):
        raise NotImplementedError

    def bench_target(self, path_or_model, *, label=None, **kwargs):
        return FakeTarget(label or self.name)


class _FakePlugin:
    from qwen_apple_backend import hookimpl

    @staticmethod
    @hookimpl
    def qab_register_backends(register):
        register("fake", "tests.test_bench:FakeBackend", description="test double")


def test_harness_does_not_care_what_the_backend_is(tiny_hf_f32):
    from qwen_apple_backend import plugins

    assert isinstance(FakeTarget("x"), BenchTarget)
    name = plugins.register_plugin(_FakePlugin(), name="fake-test-plugin")
    try:
        result = harness.run_bench(harness.BenchConfig(
            model=str(tiny_hf_f32), backends=["stock", "fake"], lengths=[16, 33], rounds=2,
            decode_tokens=3, fidelity_positions=192, bandwidth_gbs=10.0, progress=False))
    finally:
        plugins.unregister_plugin(name)
    labels = {r["backend"] for r in result["summary"]}
    assert labels == {"stock", "fake"}
    fake = [r for r in result["summary"] if r["backend"] == "fake"]
    assert all(r["ratio_vs_stock"] is not None for r in fake)
    assert result["bandwidth"] == {"source": "argument", "gbs": 10.0}
    fid = result["fidelity"]["backends"]
    assert fid["fake"]["self_agreement"] == 1.0 and fid["stock"]["agreement_vs_stock"] == 1.0
    assert 0.0 <= fid["fake"]["agreement_vs_stock"] <= 1.0


def test_time_budget_stops_between_whole_rounds(tiny_hf_f32):
    result = harness.run_bench(harness.BenchConfig(
        model=str(tiny_hf_f32), backends=["stock", "fused"], lengths=[16, 24], rounds=3,
        decode_tokens=2, warmup=0, fidelity=False, bandwidth_gbs=10.0, max_seconds=1e-3,
        progress=False))
    settings = result["settings"]
    assert settings["rounds"] == 3 and settings["rounds_completed"] == 1
    assert "time budget" in settings["stopped_early"]
    assert result["alternation"]["order_per_round"] == [["stock", "fused"]]
    assert len(result["runs"]) == len(result["alternation"]["sequence"]) == 4
    assert all(r["n"] == 1 for r in result["results"])


def test_a_length_past_the_models_context_is_named_before_the_prompt_is_built(tiny_hf_f32):
    # --lengths 10000000K failed building the prompt ids: numpy's "Unable to allocate
    # 76.3 GiB" traceback. The tiny checkpoint's max_position_embeddings is 262,144.
    with pytest.raises(ValueError) as info:
        harness.run_bench(harness.BenchConfig(
            model=str(tiny_hf_f32), backends=["stock", "fused"], lengths=[16, 10_000_000 * 1024],
            rounds=1, decode_tokens=2, fidelity=False, bandwidth_gbs=10.0, progress=False))
    assert str(info.value) == ("--lengths: 10000000K (10,240,000,000 tokens) is longer than "
                               "the model's context, max_position_embeddings 262,144")

    class Target:
        def __init__(self, label, context):
            self.label, self._context = label, context

        def max_context(self):
            return self._context

    # Targets of different contexts: the smallest, and whose it is; none: not checked.
    with pytest.raises(ValueError, match=r"^--lengths: 4K \(4,096 tokens\) is longer than the "
                                         r"model's context, max_position_embeddings 2,048 "
                                         r"\(small's model\)$"):
        harness.check_lengths_fit([512, 4096], [Target("big", 8192), Target("small", 2048)])
    harness.check_lengths_fit([4096], [Target("big", 8192), Target("unknown", None)])
    harness.check_lengths_fit([10 ** 9], [object()])


def test_environment_records_the_program_by_name_only(monkeypatch):
    # A result file names the program, never the machine path it ran from.
    from qwen_apple_backend.bench import report

    monkeypatch.setattr("sys.argv", ["/some/venv/bin/qab", "bench", "--quick"])
    env = report.environment()
    assert env["process_argv"] == ["qab", "bench", "--quick"]
    assert env["argv"] == ["qab", "bench", "--quick"]
    assert env["command_line"] == "qab bench --quick"
    assert report.environment(["qab", "bench"])["process_argv"] == ["qab", "bench", "--quick"]


def test_environment_command_line_keeps_every_option_given():
    # --backends given at its default (stock,fused) was left out of command_line,
    # while process_argv had it: command_line must paste back as the same run.
    import shlex

    from qwen_apple_backend.bench.cli import _command_line
    from qwen_apple_backend.cli import build_parser

    def settings(ns):
        return {k: v for k, v in vars(ns).items() if k not in ("_given", "_parser", "func")}

    argv = ["bench", "--preset", "tiny", "--backends", "stock,fused", "--ablate", "moe-block",
            "--warmup=1", "--quick"]
    args = build_parser().parse_args(argv)
    env = report.environment(_command_line(args, "bench"))
    assert env["command_line"] == ("qab bench --preset tiny --backends stock,fused --ablate "
                                   "moe-block --quick --warmup 1")
    assert "--backends stock,fused" in env["command_line"]
    assert "--ablate moe-block" in env["command_line"]
    pasted = shlex.split(env["command_line"])
    assert pasted[:2] == ["qab", "bench"]
    assert settings(build_parser().parse_args(pasted[1:])) == settings(args)
    # Options left out stay out; a value that starts with "-" pastes back as --flag=VALUE.
    args = build_parser().parse_args(["compare", "--preset", "tiny", "--prompt=-5 apples"])
    line = report.environment(_command_line(args, "compare"))["command_line"]
    assert line == "qab compare --preset tiny '--prompt=-5 apples'"
    assert settings(build_parser().parse_args(shlex.split(line)[1:])) == settings(args)


def _decode_split(out, context):
    """Run benchmarks/decode_split.py on the tiny preset (fused, stock, --dot);
    returns (the process, its result rows)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "decode_split.py"), str(out),
                        "--preset", "tiny", "--variants", "fused,stock", "--context", context,
                        "--tokens", "2", "--dot"],
                       capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    (result,) = out.glob("decode-split-*.json")
    return r, json.loads(result.read_text())["rows"]


def test_decode_split_counts_every_primitive_and_writes_the_graph(tmp_path):
    # benchmarks/decode_split.py records all of a token's primitives (views
    # too: each costs the host time to encode) and, with --dot, the graph.
    import re

    out = tmp_path / "o"
    _, rows = _decode_split(out, "8")
    assert [row["variant"] for row in rows] == ["fused", "stock"]
    # Each row says how it was measured: tokens per phase and the variant's switches.
    assert [(row["tokens"], row["switches"]) for row in rows] == [(2, {}), (2, {})]
    for row in rows:
        assert row["primitives"] == (row["kernel_primitives"]
                                     + sum(row["views_by_name"].values()))
        assert sum(row["by_name"].values()) == row["kernel_primitives"]
        assert set(row["views_by_name"]) <= {"Broadcast", "Reshape", "Squeeze", "ExpandDims",
                                             "Transpose", "Slice", "AsStrided", "StopGradient",
                                             "Depends", "Split", "Unflatten", "Flatten"}
        dot = (out / f"decode-step-{row['variant']}.dot").read_text()
        assert dot.startswith("digraph")
        assert len(re.findall(r"shape=rectangle", dot)) == row["primitives"]
    # The fused step has fewer primitives than stock's.
    assert rows[0]["primitives"] < rows[1]["primitives"]


def _profile_decode_host(tmp_path, *args):
    """Run benchmarks/profile_decode_host.py on the tiny preset: (process, its JSON row)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "o"
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "profile_decode_host.py"),
                        str(out), "--preset", "tiny", "--repeats", "5", *args],
                       capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    (path,) = out.glob("profile-decode-host-*.json")
    return r, json.loads(path.read_text())


def test_profile_decode_host_splits_the_pipelined_build(tmp_path):
    # benchmarks/profile_decode_host.py: the step call's host time, and per
    # token of a pipelined loop the build split into MLX's compiled function,
    # the step's bookkeeping and what runs outside the step.
    from mlx.utils import tree_flatten

    r, row = _profile_decode_host(tmp_path, "--tokens", "250")
    from qwen_apple_backend.bench.target import build_preset, fuse_in_memory

    b = build_preset("tiny", seed=0, vocab_size=1024)
    fuse_in_memory(b.model, "fused", config=b.config)
    assert row["arrays"] == len(tree_flatten(b.model.language_model.parameters()))
    assert row["tokens"] == 250 and row["layers"] == 4 and row["pipelined_tok_s"] > 0
    # The token after the first 256 positions grows the KV buffer (eager): left out of the split.
    assert row["split_tokens"] == 248
    for key in ("compiled_fn_ms", "bookkeeping_ms", "outside_ms", "pipelined_build_ms",
                "pipelined_encode_ms"):
        assert row[key] > 0, key
    # MLX's compiled function runs inside the step call, which runs inside the build.
    assert row["compiled_fn_ms"] < row["pipelined_build_ms"]
    assert "pipelined decode:" in r.stdout


def test_profile_decode_host_as_gpu_times_that_gpus_step_call(tmp_path):
    # --as-gpu cuda: the CUDA path's compiled step built on this machine through
    # count_decode_ops.py's stand-ins; only the step call is timed (the launches
    # are markers, so no pipelined loop), and the file says so.
    r, row = _profile_decode_host(tmp_path, "--as-gpu", "cuda")
    assert row["as_gpu"] == "cuda" and row["device"].endswith(" as cuda")
    assert row["step_build_ms"] > 0 and row["model_as_input_ms"] > 0 and row["layers"] == 4
    assert "pipelined_tok_s" not in row and "pipelined decode:" not in r.stdout


def test_decode_split_runs_several_contexts_on_one_preset(tmp_path):
    # --context 16,8: every variant at each length (one preset build), rows in
    # context order, the graphs named by context.
    out = tmp_path / "o"
    r, rows = _decode_split(out, "16,8")
    assert r.stdout.count("building preset") == 1
    assert [(row["variant"], row["context"]) for row in rows] == [
        ("fused", 8), ("stock", 8), ("fused", 16), ("stock", 16)]
    assert sorted(p.name for p in out.glob("*.dot")) == [
        "decode-step-fused-16.dot", "decode-step-fused-8.dot",
        "decode-step-stock-16.dot", "decode-step-stock-8.dot"]


# ---- --shared-prefill: every backend decodes from one backend's prefilled context -----------

_SHARED = dict(preset="tiny", vocab_size=1024, dtype="float32", quantize=False)


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """A decode-only sweep: fused prefills 16 and 300 tokens once (300 fills two 256-row
    KV blocks), stock and fused decode from copies, two rounds."""
    out = tmp_path_factory.mktemp("shared-out")
    result = harness.run_bench(harness.BenchConfig(
        **_SHARED, backends=["stock", "fused"], lengths=[16, 300], rounds=2, decode_tokens=5,
        fidelity=False, bandwidth_gbs=10.0, progress=False, shared_prefill="fused"))
    files = harness.write_outputs(result, out, tag="shared")
    return result, files


def test_shared_prefills_stop_when_the_time_budget_is_spent():
    # --max-seconds also bounds the shared prefills (stock's 128K prefill takes minutes):
    # a budget spent before they start leaves every length recorded as not prefilled.
    result = harness.run_bench(harness.BenchConfig(
        **_SHARED, backends=["stock", "fused"], lengths=[16, 32], rounds=1, decode_tokens=2,
        fidelity=False, bandwidth_gbs=10.0, progress=False, shared_prefill="stock",
        max_seconds=1e-6))
    assert [(e["phase"], e["length"], e["error"]) for e in result["errors"]] == [
        ("shared-prefill", n, "not prefilled: the --max-seconds budget was spent")
        for n in (16, 32)]
    assert result["runs"] == [] and result["results"] == []
    assert result["shared_prefill"]["lengths"] == []


def test_shared_prefill_decodes_every_backend_from_one_context(shared_run):
    result, files = shared_run
    assert result["settings"]["shared_prefill"] == "fused"
    assert {r["phase"] for r in result["results"]} == {"decode"}  # no prefill rows
    assert sorted((r["backend"], r["length"]) for r in result["summary"]) == [
        ("fused", 16), ("fused", 300), ("stock", 16), ("stock", 300)]
    for rec in result["results"]:
        assert rec["n"] == 2 and rec["context_from"] == "fused" and rec["decode_ids_consistent"]
    assert all(r["ratio_vs_stock"] > 0 for r in result["summary"])
    section = result["shared_prefill"]
    assert section["source"] == "fused"
    assert [r["length"] for r in section["lengths"]] == [16, 300]
    for rec in section["lengths"]:
        assert rec["source"] == "fused" and rec["prompt_tokens"] == rec["length"]
        assert rec["prefill_s"] > 0 and rec["tokens_per_s"] > 0
    assert len(result["runs"]) == 8 and not result["errors"]
    for run in result["runs"]:
        assert run["prefill_s"] is None and run["context_from"] == "fused"
        assert run["decode_tokens"] == 5 and run["decode_traffic"]["kv_cache"] > 0
    # Warm-ups: one decode per backend and length from the stored context, no prompt of their own.
    assert [(w["backend"], w["length"], w["context_from"]) for w in result["warmups"]] == [
        ("stock", 16, "fused"), ("fused", 16, "fused"), ("stock", 300, "fused"),
        ("fused", 300, "fused")]
    # Table and plot work without prefill rows (the plot: the decode panel alone).
    table = report.format_table(result["summary"])
    assert "decode" in table and "prefill" not in table
    # A label longer than the default column keeps the columns aligned.
    long = [dict(r, backend="fused-no-next-norm-x") for r in result["summary"]]
    rows = report.format_table(long).splitlines()
    assert rows[2].index("fused-no-next-norm-x") == rows[0].index("backend")
    assert all(len(row) == len(rows[0]) for row in rows[2:])
    from qwen_apple_backend.bench.cli import _header

    assert "decode only: every backend decoded from fused's prefilled contexts" in _header(result)
    png = files["png"]
    assert open(png, "rb").read(8) == PNG_SIGNATURE
    written = json.loads(open(files["json"]).read())
    assert written["shared_prefill"]["lengths"][1]["first_token"] == (
        section["lengths"][1]["first_token"])


def test_shared_prefill_decodes_what_a_normal_run_decodes(shared_run):
    # A decode from the stored context gives the token ids a normal prefill + decode of
    # the same backend gives at that length (same weights: a preset is a function of its seed).
    result, _ = shared_run
    (fused,), _ = harness.open_targets(harness.ModelSource(**_SHARED),
                                       parse_backend_specs("fused"))
    ids = harness.prompt_ids(fused.vocab_size(), 300, seed=0)
    for n in (16, 300):
        normal = harness.measure_run(fused, ids[:n], 5)
        shared = {r["decode_ids_sha256"] for r in result["runs"]
                  if r["backend"] == "fused" and r["length"] == n}
        assert shared == {normal["decode_ids_sha256"]}, n
        first = next(r["first_token"] for r in result["shared_prefill"]["lengths"]
                     if r["length"] == n)
        assert first == normal["first_token"]
    # The fidelity reserve counts the source's shared prefill, not the runs' missing ones.
    cfg = harness.BenchConfig(**_SHARED, fidelity_positions=192)
    slowest = min(r["tokens_per_s"] for r in result["shared_prefill"]["lengths"])
    assert harness._fidelity_reserve(cfg, result["runs"], result["shared_prefill"]["lengths"]) \
        == pytest.approx(10.0 + 2 * 193 / slowest)


def _cache_arrays(cache):
    """numpy copies of every array of an mlx-lm cache list (whole KV buffers included)."""
    out = []
    for c in cache:
        arrays = [c.keys, c.values] if hasattr(c, "keys") else c.cache
        out += [np.array(a) for a in arrays]
    return out


def test_mlx_context_is_a_copy_that_decodes_like_the_prefill(tiny_hf_f32):
    from qwen_apple_backend.bench.target import ContextTarget, MLXContext
    from qwen_apple_backend.loader import load_model

    fused = MLXTarget(load_model(tiny_hf_f32, "fused")[0], label="fused", prefill_step_size=5)
    stock = MLXTarget(load_model(tiny_hf_f32, "stock")[0], label="stock")
    assert isinstance(fused, ContextTarget) and not isinstance(FakeTarget("x"), ContextTarget)
    with pytest.raises(RuntimeError, match="call prefill"):
        fused.export_context()
    prompt = list(range(3, 40))
    first = fused.prefill(prompt)
    traffic = fused.decode_traffic()
    ctx = fused.export_context()
    expected = [first, *fused.decode(6)]
    assert isinstance(ctx, MLXContext) and ctx.label == "fused"
    assert ctx.first_token == first
    kv = next(c for c in ctx.cache if hasattr(c, "offset"))
    assert kv.offset == len(prompt) and kv.keys.shape[2] == 256  # preallocated buffer kept
    stored = _cache_arrays(ctx.cache)

    a = harness.measure_decode(fused, ctx, 6, keep_ids=True)
    b = harness.measure_decode(fused, ctx, 6, keep_ids=True)
    assert a["generated"] == b["generated"] == expected
    assert a["decode_ids_sha256"] == report.token_hash(expected)
    assert a["prefill_s"] is None and a["context_from"] == "fused" and a["first_token"] == first
    assert a["decode_traffic"] == traffic
    # Another target with the same cache layout decodes from it too.
    assert len(harness.measure_decode(stock, ctx, 6)["decode_ids_sha256"]) == 64
    # No decode changed the stored context.
    after = _cache_arrays(ctx.cache)
    assert len(after) == len(stored) == 2 * 3 + 2  # K, V buffers + 3 x (conv, recurrent)
    assert all(np.array_equal(x, y) for x, y in zip(stored, after))
    assert kv.offset == len(prompt)


def test_synthetic_context_has_a_prefills_shapes_and_seeded_values(tiny_hf_f32):
    # synthetic_context: every cache entry of the shapes, dtypes and KV buffer
    # capacity a real prefill of as many tokens leaves (written in the same
    # chunk pattern), offsets at the length, seeded random values (the same
    # for the same seed, other for another), the next token the one-token
    # prefill's choice; stock and fused (float32) decode the same tokens from
    # it, and decoding does not change it.
    from qwen_apple_backend.bench.target import MLXContext
    from qwen_apple_backend.loader import load_model

    fused = MLXTarget(load_model(tiny_hf_f32, "fused")[0], label="fused", prefill_step_size=64)
    stock = MLXTarget(load_model(tiny_hf_f32, "stock")[0], label="stock")
    for n in (1, 64, 65, 300):
        ids = [(7 * i + 3) % 500 for i in range(n)]
        ctx = fused.synthetic_context(ids, seed=1)
        assert isinstance(ctx, MLXContext) and ctx.label == "fused"
        assert ctx.first_token == fused.prefill([ids[-1]])
        fused.prefill(ids)
        real = fused.export_context()
        for c, r in zip(ctx.cache, real.cache, strict=True):
            assert type(c) is type(r)
            if hasattr(r, "offset"):
                assert c.offset == r.offset == n
                assert c.keys.shape == r.keys.shape and c.keys.dtype == r.keys.dtype, n
                assert c.values.shape == r.values.shape
                assert np.std(np.array(c.keys[..., :n, :])) > 0.5
            else:
                assert [(a.shape, a.dtype) for a in c.cache] == [
                    (a.shape, a.dtype) for a in r.cache]
    # (seeds past uint64 wrap around: mx.random.key takes a uint64)
    again = [np.array(a) for a in _cache_arrays(
        fused.synthetic_context(ids, seed=1 + 2 ** 64).cache)]
    other = _cache_arrays(fused.synthetic_context(ids, seed=2).cache)
    stored = _cache_arrays(ctx.cache)
    assert all(np.array_equal(x, y) for x, y in zip(stored, again))
    assert not any(np.array_equal(x, y) for x, y in zip(stored, other))
    a = harness.measure_decode(fused, ctx, 6, keep_ids=True)
    b = harness.measure_decode(stock, ctx, 6, keep_ids=True)
    assert a["generated"] == b["generated"] and a["generated"][0] == ctx.first_token
    assert all(np.array_equal(x, y) for x, y in zip(stored, _cache_arrays(ctx.cache)))
    with pytest.raises(ValueError, match="needs at least one token id"):
        fused.synthetic_context([])


def test_bench_synthetic_context_run_and_its_errors(tmp_path):
    result = harness.run_bench(harness.BenchConfig(
        **_SHARED, backends=["stock", "fused"], lengths=[16, 300], rounds=1, decode_tokens=3,
        fidelity=False, bandwidth_gbs=10.0, progress=False, shared_prefill="fused",
        synthetic_context=True))
    assert not result["errors"] and len(result["runs"]) == 4
    section = result["shared_prefill"]
    assert section["synthetic"] is True and "seeded random cache values" in section["note"]
    assert [(r["length"], r["synthetic"], r["tokens_per_s"]) for r in section["lengths"]] == [
        (16, True, None), (300, True, None)]  # a random fill has no prefill rate
    cfg = harness.BenchConfig(**_SHARED, fidelity_positions=192)
    assert harness._fidelity_reserve(cfg, result["runs"], section["lengths"]) == 10.0
    assert result["settings"]["synthetic_context"] is True
    for n in (16, 300):
        ids = {r["decode_ids_sha256"] for r in result["runs"] if r["length"] == n}
        assert len(ids) == 1, n  # stock and fused decode the same tokens (float32)
    from qwen_apple_backend.bench.cli import _header

    assert "decoded from fused's synthetic (random cache values) contexts" in _header(result)
    spent = harness.run_bench(harness.BenchConfig(
        **_SHARED, lengths=[16], rounds=1, decode_tokens=2, fidelity=False, bandwidth_gbs=10.0,
        progress=False, shared_prefill="stock", synthetic_context=True, max_seconds=1e-6))
    assert [(e["phase"], e["error"]) for e in spent["errors"]] == [
        ("synthetic-context", "not built: the --max-seconds budget was spent")]
    with pytest.raises(ValueError, match=re.escape(
            "--synthetic-context needs --shared-prefill LABEL")):
        harness.run_bench(harness.BenchConfig(**_SHARED, synthetic_context=True))
    argv = ["bench", "--preset", "tiny", "--synthetic-context", "--no-fidelity",
            "--out", str(tmp_path)]
    printed = io.StringIO()
    with contextlib.redirect_stderr(printed):
        assert main(argv) == 2
    assert "--synthetic-context needs --shared-prefill LABEL" in printed.getvalue()


def test_load_context_rejects_another_cache_layout(tiny_hf_f32):
    import dataclasses

    import mlx.core as mx

    from qwen_apple_backend.loader import load_model

    fused = MLXTarget(load_model(tiny_hf_f32, "fused")[0], label="fused")
    stock = MLXTarget(load_model(tiny_hf_f32, "stock")[0], label="stock")
    fused.prefill(list(range(3, 12)))
    ctx = fused.export_context()
    short = dataclasses.replace(ctx, cache=ctx.cache[:-1])
    with pytest.raises(ValueError, match=r"stock cannot decode from fused's context: fused's "
                                         r"cache has 3 entries, stock's 4"):
        stock.load_context(short)
    swapped = dataclasses.replace(ctx, cache=[ctx.cache[-1], *ctx.cache[1:]])
    with pytest.raises(ValueError, match=r"stock cannot decode from fused's context: cache "
                                         r"entry 0 is KVCache in fused's, ArraysCache in "
                                         r"stock's"):
        stock.load_context(swapped)
    with pytest.raises(ValueError, match="stock cannot decode from a dict context"):
        stock.load_context({"label": "x"})
    # A context of another dtype (a bfloat16 model's KV rows for this float32
    # model) is refused by name, not decoded in a promoted dtype.
    cast = copy.deepcopy(ctx.cache)
    kv = next(i for i, c in enumerate(cast) if type(c).__name__ == "KVCache")
    cast[kv].keys = cast[kv].keys.astype(mx.bfloat16)
    cast[kv].values = cast[kv].values.astype(mx.bfloat16)
    with pytest.raises(ValueError, match=rf"stock cannot decode from fused's context: cache "
                                         rf"entry {kv} holds bfloat16 keys, stock's model "
                                         r"runs in float32"):
        stock.load_context(dataclasses.replace(ctx, cache=cast))
    stock.load_context(ctx)  # the real one loads


def test_shared_prefill_needs_a_known_label_and_targets_that_load_contexts(tiny_hf_f32):
    from qwen_apple_backend import plugins

    # A label that is not a column: refused before any model is built.
    with pytest.raises(ValueError, match=r"--shared-prefill: 'fused-no-gdn' is not a backend "
                                         r"of this run \(labels: stock, fused, fused-no-moe\)"):
        harness.run_bench(harness.BenchConfig(
            model="/nonexistent", ablate=["moe"], shared_prefill="fused-no-gdn"))
    # A target without export_context / load_context: refused before the sweep.
    name = plugins.register_plugin(_FakePlugin(), name="fake-test-plugin")
    try:
        with pytest.raises(ValueError, match="--shared-prefill: backend fake cannot decode"):
            harness.run_bench(harness.BenchConfig(
                model=str(tiny_hf_f32), backends=["stock", "fake"], lengths=[16],
                rounds=1, decode_tokens=2, fidelity=False, bandwidth_gbs=10.0,
                progress=False, shared_prefill="stock"))
    finally:
        plugins.unregister_plugin(name)


def test_bench_cli_shared_prefill_without_warmup(tmp_path):
    argv = ["bench", "--preset", "tiny", "--vocab-size", "1024", "--dtype", "float32",
            "--no-quantize", "--lengths", "16", "--rounds", "1", "--decode-tokens", "2",
            "--warmup", "0", "--no-fidelity", "--bandwidth-gbs", "10", "--shared-prefill",
            "stock", "--out", str(tmp_path), "--tag", "t", "--no-progress", "--no-plot"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    result = json.loads(_json_files(tmp_path, "bench-*-t.json").read_text())
    assert result["settings"]["shared_prefill"] == "stock" and result["warmups"] == []
    assert "--shared-prefill stock" in result["environment"]["command_line"]
    assert {(r["backend"], r["context_from"]) for r in result["runs"]} == {
        ("stock", "stock"), ("fused", "stock")}
    assert "decode" in printed.getvalue() and "prefill " not in printed.getvalue()


@pytest.mark.parametrize("command, extra, dtype", [
    ("bench", ["--quick"], "bfloat16 (the default)"),
    ("compare", ["--prompt", "x", "--dtype", "float16"], "float16"),
])
def test_no_quantize_in_half_precision_on_the_cpu_is_refused_up_front(
        tmp_path, monkeypatch, capsys, command, extra, dtype):
    # Every run failed with "[GatherMM::eval] Currently only supports float32".
    from qwen_apple_backend import checkpoint

    monkeypatch.setattr(checkpoint, "gpu_available", lambda: False)
    argv = [command, "--preset", "tiny", "--vocab-size", "1024", "--no-quantize", *extra]
    if command == "bench":
        argv += ["--out", str(tmp_path)]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"qab {command}: error: --no-quantize with --dtype {dtype}: MLX's CPU backend runs "
        "unquantized MoE experts only in float32; add --dtype float32, or leave --no-quantize "
        "out\n")
    assert list(tmp_path.iterdir()) == []


def test_bench_cli_where_every_run_fails_exits_1(tmp_path, monkeypatch, capsys):
    # E.g. --no-quantize in bfloat16 on MLX's CPU: every run failed, the table was empty
    # and the exit status 0.
    def fail(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(harness, "measure_run", fail)
    argv = ["bench", "--preset", "tiny", "--vocab-size", "1024", "--lengths", "16", "--rounds",
            "1", "--decode-tokens", "2", "--no-fidelity", "--bandwidth-gbs", "10", "--out",
            str(tmp_path), "--tag", "t", "--no-progress", "--no-plot"]
    assert main(argv) == 1
    written = _json_files(tmp_path, "bench-*-t.json")
    result = json.loads(written.read_text())
    # A point whose warm-up failed is not run again: one error per backend.
    assert result["runs"] == [] and len(result["errors"]) == 2
    err = capsys.readouterr().err
    assert err.rstrip().endswith(f"qab bench: error: no run succeeded (2 failed, listed above "
                                 f"and in {written})"), err
    assert "error: stock @ 16: RuntimeError: boom" in err


@pytest.mark.parametrize("tag", ["../../x", "a/b", "x y", ""])
def test_bench_tag_is_a_file_name_part(tmp_path, tag, capsys):
    # "../../x" wrote bench-results/x.json through a stray "bench-<device>-.." folder.
    out = tmp_path / "a" / "b" / "out"
    argv = ["bench", "--preset", "tiny", "--vocab-size", "1024", "--quick", "--out", str(out),
            "--tag", tag, "--no-progress", "--no-plot"]
    if not tag:  # the default: a timestamp; only checked here, not run
        from qwen_apple_backend.cli import build_parser

        assert build_parser().parse_args(argv).tag == ""
        return
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "qab bench: error: argument --tag: must be ASCII letters, digits, '.', '_' and '-' "
        f"only (it becomes part of the file names), got {tag!r}")
    assert list(tmp_path.iterdir()) == []  # before any work: no folder made


def test_gpu_suite_tag_is_a_file_name_part(tmp_path):
    # benchmarks/run_gpu_suite.py names its files with --tag as qab bench does.
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "run_gpu_suite.py"),
                        str(tmp_path / "out"), "--tag", "../x"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith(
        "argument --tag: must be ASCII letters, digits, '.', '_' and '-' only (it becomes part "
        "of the file names), got '../x'")
    assert list(tmp_path.iterdir()) == []


def _summarize_ncu_log(tmp_path, meta, log_text):
    """Run ``benchmarks/profile_decode_gpu.py OUT --summarize LOG`` with OUT holding the run
    record ``meta`` (a dict, or raw text) and LOG holding ``log_text`` (None: no file);
    returns (the process, OUT, LOG)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "o"
    out.mkdir()
    record = meta if isinstance(meta, str) else json.dumps(meta)
    (out / "profile-decode-gpu-meta-fused.json").write_text(record)
    log = tmp_path / "ncu.csv"
    if log_text is not None:
        log.write_text(log_text)
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "profile_decode_gpu.py"),
                        str(out), "--summarize", str(log)],
                       capture_output=True, text=True, timeout=120, cwd=root)
    return r, out, log


_RUN_RECORD = dict(variant="fused", preset="full", layers=8, context=4096, tokens=2,
                   device="GPU X", profiler_marked=True)


def test_profile_decode_gpu_summarizes_an_ncu_log(tmp_path):
    # benchmarks/profile_decode_gpu.py --summarize: kernels grouped by name
    # (namespaces, template and call arguments dropped), per decode token, from
    # ncu's CSV (its own log lines and other metrics skipped, units converted,
    # thousands separators read).
    import json

    head = ('"ID","Kernel Name","Block Size","Grid Size","Metric Name","Metric Unit",'
            '"Metric Value"\n')

    def row(i, name, unit, value, metric="gpu__time_duration.sum"):
        return f'"{i}","{name}","(256, 1, 1)","(32, 1, 1)","{metric}","{unit}","{value}"\n'

    qmv = "void mlx::core::cu::qmv_kernel<8, 16, cutlass::bfloat16_t>(const T *, int)"
    csv = ("==PROF== Connected to process 1\n" + head
           + row(0, qmv, "nsecond", "12,000") + row(1, qmv, "usecond", "8")
           + row(2, "custom_kernel_qab_route(float *)", "usecond", "20")
           + row(3, qmv, "nsecond", "10,000") + row(4, qmv, "nsecond", "10,000")
           + row(5, "custom_kernel_qab_route(float *)", "msecond", "0.024")
           + row(6, qmv, "byte", "64", metric="dram__bytes_read.sum"))
    r, out, _ = _summarize_ncu_log(tmp_path, _RUN_RECORD, csv)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((out / "profile-decode-gpu-fused-gpu-x.json").read_text())
    assert res["launches_per_token"] == 3.0 and res["kernel_us_per_token"] == pytest.approx(42.0)
    assert [k["kernel"] for k in res["kernels"]] == ["custom_kernel_qab_route", "qmv_kernel"]
    route, qmv_row = res["kernels"]
    assert route["launches_per_token"] == 1.0 and route["us_per_token"] == pytest.approx(22.0)
    assert qmv_row["launches_per_token"] == 2.0 and qmv_row["us_per_launch"] == 10.0
    assert qmv_row["share"] == pytest.approx(20 / 42) and res["context"] == 4096
    assert "fused @4096, 8 layers: 3 launches, 42.0 us of kernels per token" in r.stdout
    assert res["notes"] == [] and "note:" not in r.stdout


@pytest.mark.parametrize("body,message", [
    ('"Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
     '"k","gpu__time_duration.sum","fortnight","3"\n', "row 2: unknown time unit 'fortnight'"),
    ('"Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
     '"k","gpu__time_duration.sum","usecond","n/a"\n', "row 2: metric value 'n/a' is not a"),
    ('"Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
     '"k","gpu__time_duration.sum","usecond","-5"\n', "row 2: metric value '-5' is not a"),
    ('"Kernel","Metric"\n"k","x"\n', "not an ncu --csv log (no column"),
    ("==PROF== nothing profiled\n", "no gpu__time_duration.sum rows"),
    (None, "cannot read the ncu log (FileNotFoundError"),
])
def test_profile_decode_gpu_rejects_bad_ncu_logs(tmp_path, body, message):
    # One line naming the file (and row), no traceback, no result file.
    r, out, log = _summarize_ncu_log(tmp_path, _RUN_RECORD, body)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"{log}: " in r.stderr and message in r.stderr, r.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["profile-decode-gpu-meta-fused.json"]


def _benchmark_module(monkeypatch, name):
    """benchmarks/<name>.py freshly imported, with benchmarks/ on the path for
    this test (as the script itself runs)."""
    import importlib
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    monkeypatch.delitem(sys.modules, name, raising=False)
    return importlib.import_module(name)


def test_profile_decode_gpu_notes_a_log_that_is_not_whole_tokens(tmp_path, monkeypatch):
    # 3 launches for 2 tokens: the log holds other kernels too (or another
    # run's), which the summary says rather than dividing silently.
    pdg = _benchmark_module(monkeypatch, "profile_decode_gpu")

    log = tmp_path / "ncu.csv"
    log.write_text('"Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
                   + '"void a::k<1>(int)","gpu__time_duration.sum","usecond","2"\n' * 3)
    res = pdg.summarize(log, 2)
    assert res["launches_per_token"] == 1.5 and res["kernel_us_per_token"] == 3.0
    assert res["kernels"][0]["kernel"] == "k"
    assert res["notes"] == ["3 launches are not a multiple of 2 tokens: the log holds other "
                            "kernels too, or another run's"]


@pytest.mark.parametrize("meta,message", [
    ("{bad", "not this script's run record (JSONDecodeError"),
    ('{"tokens": 2}', "not this script's run record (KeyError: 'context, device, layers, variant')"),
    ('{"variant": "fused", "context": 8, "layers": null, "tokens": 0, "device": "X"}',
     "tokens must be >= 1, got 0"),
])
def test_profile_decode_gpu_rejects_a_bad_run_record(tmp_path, meta, message):
    r, _, _ = _summarize_ncu_log(tmp_path, meta, None)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert message in r.stderr, r.stderr[-2000:]


def test_decode_split_takes_any_switch_as_a_fused_variant(tmp_path):
    # fused-NAME for a name outside the built-in list: fused with
    # QAB_DISABLE=NAME, recorded in the row.
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "o"
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "decode_split.py"), str(out),
                        "--preset", "tiny", "--variants", "fused-moe-route", "--context", "8",
                        "--tokens", "2"], capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    (path,) = out.glob("decode-split-*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["variant"] == "fused-moe-route"
    assert row["switches"] == {"QAB_DISABLE": "moe-route"} and row["tokens"] == 2


def test_profile_moe_block_gpu_summarizes_per_candidate(tmp_path):
    # benchmarks/profile_moe_block_gpu.py --summarize: the marker sort splits
    # the log into the run record's candidates; each one's kernels per call.
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "o"
    out.mkdir()
    (out / "profile-moe-block-gpu-run.json").write_text(json.dumps(
        dict(device="GPU X", reps=2, profiler=True, order=["three-launch", "default"])))
    head = ('"ID","Kernel Name","Block Size","Grid Size","Metric Name","Metric Unit",'
            '"Metric Value"\n')
    sort = "void mlx::core::cu::block_sort_kernel<float>(const float *)"
    route, gu, block = ("custom_kernel_qab_moe_add_norm_route_bf16(const T *)",
                        "custom_kernel_qab_moe_gate_up_shared_gemv_bf16(const T *)",
                        "custom_kernel_qab_moe_decode_block_bf16_32_f_t(const T *)")
    calls = [(sort, 2), (route, 9), (gu, 11), (route, 10), (gu, 12), (sort, 2), (block, 43),
             (block, 45), (sort, 2)]
    rows = "".join(f'"{i}","{n}","(256, 1, 1)","(32, 1, 1)","gpu__time_duration.sum",'
                   f'"usecond","{us}"\n' for i, (n, us) in enumerate(calls))
    log = tmp_path / "ncu.csv"
    log.write_text("==PROF== Connected\n" + head + rows)
    script = str(root / "benchmarks" / "profile_moe_block_gpu.py")
    r = subprocess.run([sys.executable, script, str(out), "--summarize", str(log)],
                       capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((out / "profile-moe-block-gpu-gpu-x.json").read_text())
    assert [(x["candidate"], x["launches"], x["us"]) for x in res["rows"]] == [
        ("three-launch", 2, 21.0), ("default", 1, 44.0)]
    assert res["rows"][0]["kernels_us"] == {
        "custom_kernel_qab_moe_add_norm_route_bf16": 9.5,
        "custom_kernel_qab_moe_gate_up_shared_gemv_bf16": 11.5}
    # A variant naming an unknown option: argparse's one line, before any GPU work.
    r = subprocess.run([sys.executable, script, str(out), "--variants", "CS=32+PREFETHC"],
                       capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 2 and "unknown option 'PREFETHC'" in r.stderr, r.stderr[-500:]
    for variants, message in [("CS=x", "CS='x' is not an integer"), ("CS=0", "CS must be >= 1"),
                              (",", "one or more distinct variants"),
                              ("default,default", "one or more distinct variants")]:
        r = subprocess.run([sys.executable, script, str(out), "--variants", variants],
                           capture_output=True, text=True, timeout=120, cwd=root)
        assert r.returncode == 2 and message in r.stderr, (variants, r.stderr[-500:])
    # Run records a summary cannot use: one line naming the file and the field.
    for record, message in [({"reps": 0, "order": ["a"]}, "reps 0"),
                            ({"reps": 2, "order": "abc"}, "order 'abc'"),
                            ({"order": ["a"]}, "reps None")]:
        (out / "profile-moe-block-gpu-run.json").write_text(json.dumps(record))
        r = subprocess.run([sys.executable, script, str(out), "--summarize", str(log)],
                           capture_output=True, text=True, timeout=120, cwd=root)
        assert r.returncode == 1 and "Traceback" not in r.stderr and message in r.stderr, (
            record, r.stderr[-500:])
    # Profiling itself on a machine without CUDA: one line, before any work.
    import mlx.core as mx

    if not mx.cuda.is_available():
        r = subprocess.run([sys.executable, script, str(tmp_path / "o2")],
                           capture_output=True, text=True, timeout=120, cwd=root)
        assert r.returncode == 2 and "needs MLX's CUDA backend" in r.stderr, r.stderr[-500:]
        assert not (tmp_path / "o2").exists()


def test_profile_moe_block_gpu_build_keys_and_prefetch_wait_median():
    # RELAXED and STAGE are variant keys (a build define, a block option); a
    # launch's mark-3 median (down items' end of waiting for gate/up) skips
    # tickets without the mark and is None for a build that sets none.
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        import profile_moe_block_gpu as prof
    finally:
        sys.path.remove(str(root / "benchmarks"))
    assert prof.parse_variant("RELAXED+STAGE") == {"RELAXED": True, "STAGE": True}
    assert prof.parse_variant("STAGE=0+EARLY=1") == {"STAGE": False, "EARLY": True}
    assert prof.parse_variant("GRPW=4+MINB=2") == {"GRPW": 4, "MINB": 2}
    with pytest.raises(ValueError, match="EARLY is a flag: 0 or 1, got 2"):
        prof.parse_variant("EARLY=2")
    with pytest.raises(ValueError, match="STAGE given twice"):
        prof.parse_variant("STAGE=0+STAGE=1")
    # NPS takes 0 (every other count option starts at 1); MANT is a flag.
    assert prof.parse_variant("NPS=0+MANT") == {"NPS": 0, "MANT": True}
    with pytest.raises(ValueError, match="MANT is a flag"):
        prof.parse_variant("MANT=2")
    assert prof.build_prefix({"MANT": True}) == "#define QAB_NIBBLE_MANTISSA 1\n"
    assert prof.build_prefix({"RELAXED": True}) == "#define QAB_WAIT_RELAXED 1\n"
    assert prof.build_prefix({"RELAXED": 0, "STAGE": True}) == ""
    # A row per ticket: marks 0 (start), 1 (wait end), 2 (work end), 3, then the SM.
    stamps = [[100, 0, 900, 0, 1], [150, 300, 1500, 700, 2], [120, 310, 1300, 0, 3],
              [130, 320, 1400, 500, 4]]
    assert prof.med_s(stamps, 1, 4) == 600  # marks 3 of 700 and 500 less t0 = 100: 400, 600
    assert prof.med_s(stamps, 0, 1) is None


def test_profile_gemv_gpu_splits_an_ncu_log_at_its_markers(tmp_path):
    # benchmarks/profile_gemv_gpu.py --summarize: the log's first launch is the
    # marker sort; the launches between two markers are one candidate's reps,
    # averaged per call, with the weights' bytes per microsecond.
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "o"
    out.mkdir()
    order = [dict(shape="in_proj", N=12352, K=2048, weight_bytes=14_000_000, candidate="mlx"),
             dict(shape="in_proj", N=12352, K=2048, weight_bytes=14_000_000,
                  candidate="mlx-norm")]
    (out / "profile-gemv-gpu-run.json").write_text(json.dumps(
        dict(device="GPU X", dtype="bfloat16", reps=2, profiler=True, order=order)))
    head = ('"ID","Kernel Name","Block Size","Grid Size","Metric Name","Metric Unit",'
            '"Metric Value"\n')
    rows, i = [], 0

    def row(name, unit, value):
        nonlocal i
        i += 1
        return f'"{i}","{name}","(256, 1, 1)","(32, 1, 1)","gpu__time_duration.sum","{unit}","{value}"\n'

    sort = "void mlx::core::cu::block_sort_kernel<float>(const float *)"
    qmv = "void mlx::core::cu::qmv_kernel<8, 16>(const T *, int)"
    norm = "void mlx::core::cu::rms_norm_small<256>(const T *)"
    rows = [row(sort, "usecond", 2), row(qmv, "usecond", 18), row(qmv, "nsecond", "20,000"),
            row(sort, "usecond", 2), row(norm, "usecond", 3), row(qmv, "usecond", 18),
            row(norm, "usecond", 3), row(qmv, "usecond", 18), row(sort, "usecond", 2)]
    log = tmp_path / "ncu.csv"
    log.write_text("==PROF== Connected\n" + head + "".join(rows))
    script = str(root / "benchmarks" / "profile_gemv_gpu.py")
    r = subprocess.run([sys.executable, script, str(out), "--summarize", str(log)],
                       capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads((out / "profile-gemv-gpu-gpu-x.json").read_text())
    got = [(x["candidate"], x["launches"], x["us"], x["kernels"]) for x in res["rows"]]
    assert got == [("mlx", 1, 19.0, ["qmv_kernel"]),
                   ("mlx-norm", 2, 21.0, ["rms_norm_small", "qmv_kernel"])]
    assert res["rows"][0]["tb_per_s"] == round(14e6 / 19e6, 3)
    # One segment short of the run record: a one-line error naming the file.
    log.write_text(head + "".join(rows[:4]))
    r = subprocess.run([sys.executable, script, str(out), "--summarize", str(log)],
                       capture_output=True, text=True, timeout=120, cwd=root)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert f"{log}: 1 marked segments for 2 candidate x shape pairs" in r.stderr


def test_profile_gemv_gpu_makes_each_kind_of_epsilon_array():
    # --eps-array: device is what the package ships (ops.device.f32_scalar);
    # pool is the [1] host array it passed before (MLX's <= 8-byte pool on CUDA).
    import importlib.util
    from pathlib import Path

    import mlx.core as mx

    from qwen_apple_backend.ops.device import f32_scalar

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_gemv_gpu.py"
    spec = importlib.util.spec_from_file_location("profile_gemv_gpu_t", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod._eps_arrays("device") is f32_scalar
    for kind, n in (("pool", 1), ("host", 4)):
        make = mod._eps_arrays(kind)
        a = make(1e-6)
        assert a is make(1e-6) and a.shape == (n,) and a.dtype == mx.float32
        assert mx.all(a == mx.array(1e-6, dtype=mx.float32)).item()


def test_profile_gemv_gpu_launch_variants_reach_the_kernel_call(monkeypatch):
    # --variants / --rpw: the wrapped candidate launches with the variant's
    # build and grid even though the kernel call passes its own pipe.
    import importlib.util
    from pathlib import Path

    from qwen_apple_backend.ops import linear as lin

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_gemv_gpu.py"
    spec = importlib.util.spec_from_file_location("profile_gemv_gpu_v", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.parse_variant("pipe+rpw2+bps3") == {"pipe": True, "rpw": 2, "bps": 3}
    with pytest.raises(ValueError, match="'rpw0' in 'pipe\\+rpw0'"):
        mod.parse_variant("pipe+rpw0")
    monkeypatch.setattr(lin, "cuda_sm_count", lambda: 10)
    seen = lambda: lin.gemv_launch(1, 12352, 2048, pipe=False)  # noqa: E731 (the kernel's call)
    p = mod._with_launch(lin, seen, rpw=2, pipe=True, bps=3)()
    assert (p["PIPE"], p["RPW"], p["blocks"]) == (True, 2, 30)
    p = mod._with_launch(lin, seen, rpw=4)()
    assert (p["PIPE"], p["RPW"], p["blocks"]) == (False, 4, -(-12352 // 32))
    assert lin.gemv_launch(1, 12352, 2048) == seen()  # put back after the call


def test_fidelity_lines_stay_aligned_for_long_labels(capsys):
    from qwen_apple_backend.bench.cli import _print_fidelity

    row = {"agreement_vs_stock": 1.0, "perplexity": 2.0, "perplexity_rel_vs_stock": 0.0,
           "self_agreement": 1.0}
    _print_fidelity({"positions": 4, "baseline": "stock",
                     "backends": {"stock": row, "fused-no-norm-proj": row}})
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "top-1" in ln]
    assert len(lines) == 2 and len({ln.index("top-1") for ln in lines}) == 1


def test_ablating_an_opt_in_that_is_off_warns(monkeypatch, capsys):
    # --ablate of an opt-in optimization without QAB_ENABLE would add a column
    # identical to `fused`: bench and compare say so on stderr (and only then).
    import argparse

    from qwen_apple_backend.bench.cli import _warn_opt_in_ablations

    monkeypatch.delenv("QAB_ENABLE", raising=False)
    _warn_opt_in_ablations(argparse.Namespace(ablate="moe, l2-prefetch,gemv-pipe"))
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"warning: --ablate {n}: opt-in, so `fused` runs without it too unless "
        f"QAB_ENABLE={n}: fused-no-{n} is the same model as fused"
        for n in ("l2-prefetch", "gemv-pipe")]
    monkeypatch.setenv("QAB_ENABLE", "l2-prefetch")
    _warn_opt_in_ablations(argparse.Namespace(ablate="l2-prefetch,moe-block"))
    assert capsys.readouterr().err == ""


def test_count_decode_ops_counts_the_arrays_each_launch_binds(tmp_path):
    # benchmarks/count_decode_ops.py --as-gpu cuda at Qwen3.6's widths (4
    # layers: 3 Gated DeltaNet, 1 attention; 16 experts), one run (the model
    # build is most of its time) with three fused columns. Counted on the
    # compiled decode step (a GPU's default).
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "o"
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "count_decode_ops.py"),
                        str(out), "--preset", "full", "--layers", "4", "--experts", "16",
                        "--context", "4", "--backends", "fused", "--ablate", "moe-block-pack",
                        "--enable", "l2-prefetch", "--as-gpu", "cuda"],
                       capture_output=True, text=True, timeout=600, cwd=root)
    assert r.returncode == 0, r.stderr[-2000:]
    (path,) = out.glob("decode-ops-*.json")
    result = json.loads(path.read_text())["rows"]
    assert [row["column"] for row in result] == ["fused", "fused -moe-block-pack",
                                                 "fused +l2-prefetch"]
    assert [(row["disabled"], row["enabled"]) for row in result] == [
        ("", ""), ("moe-block-pack", ""), ("", "l2-prefetch")]
    rows = {row["column"]: row["bound_arrays"] for row in result}

    # moe-block-pack: each MoE layer's one-launch block binds its router,
    # shared expert and routed experts as one pack instead of 21 arrays, so a
    # decode token binds exactly 20 distinct arrays fewer per layer than with
    # the pack off, and makes 3 outputs fewer per Gated DeltaNet layer (its
    # workspace and the two states, written in place) and 1 fewer per
    # attention layer (the workspace).
    packed, unpacked = rows["fused"], rows["fused -moe-block-pack"]
    for row in (packed, unpacked):
        assert 0 < row["distinct"] <= row["bound"]
        assert row["launches"] == sum(v[0] for v in row["by_name"].values())
        assert row["distinct"] == sum(v[2] for v in row["by_name"].values())
    assert unpacked["distinct"] - packed["distinct"] == 20 * 4
    assert unpacked["bound"] - packed["bound"] == 20 * 4
    assert packed["by_name"]["qab:moe_decode_block_gdn_pack"][:2] == [3, 3 * 27]
    assert packed["by_name"]["qab:moe_decode_block_pack"][:2] == [1, 18]
    assert packed["by_name"]["qab:moe_decode_block_gdn_pack"][3] == 3 * 2
    assert packed["by_name"]["qab:moe_decode_block_pack"][3] == 2
    assert unpacked["by_name"]["qab:moe_decode_block_gdn"][3] == 3 * 5
    assert unpacked["outputs"] - packed["outputs"] == 3 * 3 + 1
    assert "qab:moe_decode_block_gdn" in unpacked["by_name"]
    # The counted token is a steady-state replay in both columns (not the
    # step's eager pack-check call, nor its first compiled call, which copies
    # the caches' buffers): the same primitives but the stand-ins' two markers
    # per output the pack saves.
    prims = {row["column"]: row["primitives"] for row in result}
    assert prims["fused -moe-block-pack"] - prims["fused"] == 2 * (3 * 3 + 1), prims

    # l2-prefetch (QAB_ENABLE) inside the compiled decode step: each MoE block
    # with a next layer takes that layer's concatenated projection (weight,
    # scales, biases) as arguments of its compiled call. Read as closure
    # arrays they made MLX refuse the trace ("uncaptured inputs"): every fused
    # column with l2-prefetch on failed on an H100 (2026-12-05). The three
    # Gated DeltaNet layers' blocks bind 3 more distinct arrays each, the last
    # layer's block (no next layer) none; the same launches.
    on, off = rows["fused +l2-prefetch"], rows["fused"]
    assert on["launches"] == off["launches"]
    gdn, last = "qab:moe_decode_block_gdn_pack", "qab:moe_decode_block_pack"
    assert on["by_name"][gdn][0] == 3
    assert on["by_name"][gdn][2] - off["by_name"][gdn][2] == 3 * 3
    assert on["by_name"][last] == off["by_name"][last]


def test_count_decode_ops_rejects_an_enable_name_that_is_not_opt_in(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    for name, why in (("moe-block-pack", "--enable: 'moe-block-pack' is on by default"),
                      ("Bogus", "--enable: unknown optimization 'Bogus'")):
        r = subprocess.run([sys.executable, str(root / "benchmarks" / "count_decode_ops.py"),
                            str(tmp_path / "o"), "--enable", name],
                           capture_output=True, text=True, timeout=120, cwd=root)
        assert r.returncode == 2, r.stderr
        assert why in r.stderr and "l2-prefetch" in r.stderr, r.stderr
        assert not (tmp_path / "o").exists()


def _gpu_session_module():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.py"
    spec = importlib.util.spec_from_file_location("gpu_session", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("plan, message", [
    ("bench:30,probe:5", "unknown step 'probe'"),
    ("bench", "step 'bench' needs its seconds, as bench:300"),
    ("tests:soon", "step 'tests': 'soon' is not a number of seconds"),
    ("tests:0", "step 'tests': seconds must be positive and finite, got 0"),
    ("tests:nan", "step 'tests': seconds must be positive and finite, got nan"),
    ("bench:inf", "step 'bench': seconds must be positive and finite, got inf"),
    ("tests:5,tests:6", "step 'tests' named twice"),
    (" , ", "no steps"),
])
def test_gpu_session_plan_errors_name_the_step(plan, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _gpu_session_module().parse_plan(plan)


def test_gpu_session_plan_and_bench_arguments():
    mod = _gpu_session_module()
    assert mod.parse_plan("bench:330, tests : 200") == [("bench", 330.0), ("tests", 200.0)]
    argv = mod.bench_argv("bench", Path("o"), "moe-block-pack")
    assert argv[argv.index("--lengths") + 1] == "4K"
    assert argv[argv.index("--ablate") + 1] == "moe-block-pack"
    assert argv[argv.index("--out") + 1] == str(Path("o") / "bench")
    assert "--ablate" not in mod.bench_argv("bench", Path("o"), "")
    assert argv[argv.index("--shared-prefill") + 1] == "stock" and "--synthetic-context" in argv
    real = mod.bench_argv("bench", Path("o"), "", real_prefill=True)
    assert real[real.index("--shared-prefill") + 1] == "fused"
    assert "--synthetic-context" not in real
    lengths = mod.bench_argv("lengths", Path("o"), "x")
    assert lengths[lengths.index("--lengths") + 1].split(",")[-1] == "128K"
    assert "--ablate" not in lengths
    # The long step: 128K, or its own lengths, and its own ablation columns.
    long = mod.bench_argv("long", Path("o"), "")
    assert long[long.index("--lengths") + 1] == "128K" and "--ablate" not in long
    long = mod.bench_argv("long", Path("o"), "attn-step-long", long_lengths="64K,128K")
    assert long[long.index("--lengths") + 1] == "64K,128K"
    assert long[long.index("--ablate") + 1] == "attn-step-long"


def test_gpu_session_runs_steps_in_one_process_and_stops_an_overdue_one(tmp_path):
    # The steps' output (Python's and C-level writes to fds 1/2) lands in
    # each step's file, the session log gets a line per step, a failing step
    # does not stop the next, and a step over its seconds ends the process
    # with 124 and its stack in its file.
    script = textwrap.dedent(f"""
        import os, sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / "benchmarks")!r})
        import gpu_session as g
        calls = []
        def bench(argv, enable):
            print("bench says", argv[argv.index("--lengths") + 1], enable, os.getpid())
            os.write(2, b"from fd 2\\n")
            return 3
        def tests(filter_):
            print("tests", filter_, os.getpid(), flush=True)
            time.sleep(30)
            return 0
        g.run_bench, g.run_tests = bench, tests
        g.gpu_available = lambda: True  # (the faked steps need none)
        sys.exit(g.main([sys.argv[1], "--plan", "bench:20,long:20,tests:1", "--test-filter", "k1",
                         "--long-lengths", "64K,128K",
                         "--long-ablate", "attn-merge-split,moe-block-pack"]))
    """)
    out = tmp_path / "s"
    r = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 124, r.stdout + r.stderr
    bench = (out / "bench.txt").read_text()
    tests = (out / "tests.txt").read_text()
    pid = re.search(r"bench says 4K decode-const (\d+)", bench)
    assert pid and "from fd 2" in bench, bench
    assert tests.split("\n")[0].split()[-1] == pid.group(1)  # one process
    # The long step: its own lengths and ablation columns, its opt-ins switched on.
    long = (out / "long.txt").read_text()
    assert f"bench says 64K,128K attn-merge-split {pid.group(1)}" in long, long
    assert tests.startswith("tests k1") and "over its 1 s, stacks:" in tests
    assert "in tests" in tests  # the dumped stack names the step's function
    log = (out / "session.log").read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in log][:3] == [
        "plan bench:20,long:20,tests:1", "bench: start (20 s)", "bench: rc 3 in " +
        log[2].split(" in ")[1]]
    # A failed step's log line ends with its file's last line (its error).
    assert log[2].endswith("(0 self-checks so far, OUT/self-checks.json); last output: "
                           "from fd 2")
    assert json.loads((out / "self-checks.json").read_text()) == []
    assert log[3].endswith("long: start (20 s)") and " long: rc 3 in " in log[4]
    assert log[5].endswith("tests: start (1 s)")
    assert log[6].endswith("tests: over its 1 s; stopped (stacks in tests.txt)")
    assert "bench: rc 3" in r.stdout  # the log lines also reach the console


def test_gpu_session_refuses_a_machine_without_a_cuda_gpu(tmp_path):
    # On this CPU machine the session stops before any step (its bench step
    # would build the full ~35B-parameter model here) and makes no folder.
    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks"
                                            / "gpu_session.py"), str(tmp_path / "s")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "its steps need MLX's CUDA backend and a CUDA GPU" in r.stderr
    assert not (tmp_path / "s").exists()
    # A layer variant ops.moe would refuse is named first, wherever it runs.
    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks"
                                            / "gpu_session.py"), str(tmp_path / "s"),
                        "--plan", "layer:60", "--layer-variants", "default,PRW=8"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--layer-variants: variant 'PRW=8': PRW must be one of 1, 2, 4, got 8" in r.stderr


def test_gpu_session_bench_step_runs_qab_bench_in_process(tmp_path, monkeypatch):
    # run_bench: qab bench in this process (tiny preset here), with the step's
    # QAB_ENABLE added for the step only.
    mod = _gpu_session_module()
    monkeypatch.setenv("QAB_ENABLE", "next-norm")
    seen = []
    from qwen_apple_backend import cli

    real = cli._main

    def spy(argv):
        seen.append(os.environ.get("QAB_ENABLE"))
        return real(argv)

    monkeypatch.setattr(cli, "_main", spy)
    rc = mod.run_bench(["bench", "--preset", "tiny", "--lengths", "16", "--rounds", "1",
                        "--decode-tokens", "2", "--no-fidelity", "--no-plot", "--no-progress",
                        "--out", str(tmp_path / "b")], "decode-const")
    assert rc == 0
    assert seen == ["next-norm,decode-const"]
    assert os.environ["QAB_ENABLE"] == "next-norm"
    assert list((tmp_path / "b").glob("*.json")), list((tmp_path / "b").iterdir())


def test_gpu_session_layer_steps_run_the_layer_profiler_in_process(tmp_path, monkeypatch):
    # The layer and timeline steps call benchmarks/profile_layer_gpu.py's main
    # in this process with the step's folder and the session's
    # --layer-variants (timeline adding --timeline and --warm, the session's
    # --timeline-warm); its usage errors come
    # back as the step's status, not as the session's exit.
    import importlib

    mod = _gpu_session_module()
    assert mod.parse_plan("layer:100,timeline:50") == [("layer", 100.0), ("timeline", 50.0)]
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    prof = importlib.import_module("profile_layer_gpu")
    calls = []
    monkeypatch.setattr(prof, "main", lambda argv: calls.append(argv) or 0)
    assert mod.run_layer(tmp_path, "default,GRPW=4", False) == 0
    assert mod.run_layer(tmp_path, "default", True) == 0
    assert mod.run_layer(tmp_path, "default", True, 4) == 0  # --timeline-warm 4
    assert calls == [[str(tmp_path / "layer"), "--variants", "default,GRPW=4"],
                     [str(tmp_path / "timeline"), "--variants", "default", "--timeline",
                      "--warm", "0"],
                     [str(tmp_path / "timeline"), "--variants", "default", "--timeline",
                      "--warm", "4"]]

    def refuse(argv):
        raise SystemExit(2)

    monkeypatch.setattr(prof, "main", refuse)
    assert mod.run_layer(tmp_path, "BOGUS", False) == 2
    monkeypatch.setattr(prof, "main", lambda argv: (_ for _ in ()).throw(
        SystemExit("variant PACK=0: its state differs from default's")))
    assert mod.run_layer(tmp_path, "default,PACK=0", False) == 1


def test_bench_without_a_model_uses_the_demo_model(tmp_path):
    # As qab generate / chat / serve without --model: neither --model nor
    # --preset benches the shipped demo model, and says so on stderr.
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["bench", "--lengths", "16", "--rounds", "1", "--decode-tokens", "2",
                   "--no-fidelity", "--no-plot", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0, err.getvalue()[-2000:]
    assert "qab bench: no --model or --preset given; using the demo model (" in err.getvalue()
    (path,) = tmp_path.glob("bench-*.json")
    result = json.loads(path.read_text())
    assert "demo-model-" in str(result["model"]), result["model"]
    assert [r["backend"] for r in result["results"] if r["phase"] == "decode"] == [
        "stock", "fused"]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["compare", "--prompt", "The os module", "--max-tokens", "2"])
    assert rc == 0, err.getvalue()[-2000:]
    assert "qab compare: no --model or --preset given; using the demo model (" in err.getvalue()


def test_profile_attention_decode_launch_marks_and_forms(monkeypatch):
    # The step's timeline from one launch's marks (global-timer ns per thread
    # block, 0 where a mark does not apply, the SM id last): starts, staging and
    # pass of the blocks that staged a query row, the merge's own steps from the
    # blocks that merged; us from the first block's start. And the timeline
    # forms: a key's form, with or without -ctasN; not the other forms.
    pad = _benchmark_module(monkeypatch, "profile_attention_decode")

    assert pad.MARKS == 9

    def row(t, merge=None, sm=7):
        # marks 0-3 at t, t + 1, t + 2, t + 3 us; a merging block's 4-8 after.
        r = [t * 1000, (t + 1) * 1000, (t + 2) * 1000, (t + 3) * 1000] + [0] * 5 + [sm]
        if merge is not None:  # fence, max, weights, rows, done: merge + 1..5 us
            r[8], r[5], r[6], r[7], r[4] = (1000 * (merge + k) for k in range(1, 6))
        return r

    # Three blocks start at 10, 12 and 13 us; one past the token's key stages
    # nothing (mark 1 is 0): left out of the staging and pass medians.
    past = row(11)
    past[1] = 0
    got = pad.launch_marks([row(10), row(12), row(13, merge=20), past])
    assert got == {"start_last": 3.0, "staged_median": 3.0, "staged_last": 4.0,
                   "pass_median": 4.0, "pass_last": 5.0, "counted_last": 6.0,
                   "fenced_last": 11.0, "max_last": 12.0, "weights_last": 13.0,
                   "rows_last": 14.0, "merged_last": 15.0}
    assert pad.timeline_form("step") == (True, False, None, False, None)
    assert pad.timeline_form("step-kv-prefetch-ctas64") == (True, False, "QAB_STEP_KV_PREFETCH",
                                                           False, 64)
    assert pad.timeline_form("step-merge-spread-ctas32") == (True, False, None, True, 32)
    assert pad.timeline_form("step-ctasx") is None
    assert pad.timeline_form("sdpa") is None


def test_read_prompts_reads_three_forms_and_names_the_file_on_errors(tmp_path):
    from qwen_apple_backend.bench.compare import read_prompts

    (tmp_path / "p.txt").write_text("first\n\n  second  \n", encoding="utf-8")
    assert read_prompts(tmp_path / "p.txt") == ["first", "second"]
    (tmp_path / "p.json").write_text('["a", "b"]', encoding="utf-8")
    assert read_prompts(tmp_path / "p.json") == ["a", "b"]
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n{"text": "y"}\n', encoding="utf-8")
    assert read_prompts(tmp_path / "p.jsonl") == ["x", "y"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n{"prompt": "a\n', encoding="utf-8")
    (tmp_path / "bad.json").write_text('["x",\n', encoding="utf-8")
    (tmp_path / "list.jsonl").write_text('{"prompt": "x"}\n{]\n', encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes(b"caf\xe9\n")
    (tmp_path / "empty.txt").write_text("\n\n", encoding="utf-8")
    for name, message in (
            ("bad.jsonl", r"bad\.jsonl: line 2: not valid JSON: Unterminated string"),
            ("bad.json", r"bad\.json: not a valid JSON list of prompts: Expecting value"),
            ("list.jsonl", r"list\.jsonl: line 2: not valid JSON"),
            ("latin1.txt", r"latin1\.txt: cannot read the prompts file: 'utf-8' codec"),
            ("empty.txt", r"empty\.txt: no prompts found"),
            ("missing.txt", r"missing\.txt: prompts file not found"),
            ("", r": cannot read the prompts file: Is a directory")):
        with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path))}/{message}"
                           if name else rf"^{re.escape(str(tmp_path))}{message}"):
            read_prompts(tmp_path / name)
