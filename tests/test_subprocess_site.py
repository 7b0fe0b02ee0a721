"""The tests' subprocess site (``_subprocess_site/sitecustomize.py``): torch hidden, and
transformers' import structure cached per session with the value transformers computes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import SUBPROCESS_SITE

# Prints, from a subprocess started with the site: whether torch imports, and the import
# structure of transformers' models folder (keys and values as sorted lists).
PROBE = r"""
import json, sys
from pathlib import Path
try:
    import torch
    print("torch", torch is not None)
except ImportError:
    print("torch", False)
import transformers
from transformers.utils import import_utils
s = import_utils.define_import_structure(Path(transformers.__file__).parent / "models",
                                         prefix="models")
print(json.dumps(sorted((sorted(k), sorted((m, sorted(n)) for m, n in v.items()))
                        for k, v in s.items())))
"""


def _probe(cache) -> tuple[str, str]:
    env = dict(os.environ, PYTHONPATH=str(SUBPROCESS_SITE))
    env.pop("QAB_TEST_IMPORT_STRUCTURE_DIR", None)
    if cache is not None:
        env["QAB_TEST_IMPORT_STRUCTURE_DIR"] = str(cache)
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    torch_line, structure = r.stdout.strip().splitlines()[-2:]
    return torch_line, structure


def test_subprocesses_hide_torch_and_load_the_import_structure_transformers_computes(tmp_path):
    own = _probe(None)  # transformers' own function
    assert own[0] == "torch False"
    assert '"models.qwen3_5.configuration_qwen3_5"' in own[1]
    assert _probe(tmp_path) == own  # computes and stores
    stored = sorted(tmp_path.glob("import-structure-*.pickle"))
    assert stored, "the first subprocess stored no import structure"
    mtimes = [f.stat().st_mtime_ns for f in stored]
    assert _probe(tmp_path) == own  # loads
    assert [f.stat().st_mtime_ns for f in stored] == mtimes
    # An unreadable file is computed again (and replaced), not an error.
    for f in stored:
        f.write_bytes(b"not a pickle")
    assert _probe(tmp_path) == own
    assert all(f.read_bytes() != b"not a pickle" for f in stored)
