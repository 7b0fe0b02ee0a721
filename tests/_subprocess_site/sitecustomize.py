"""Run by every Python subprocess the tests start (conftest.py puts this folder first on
PYTHONPATH): hides torch from them, as from a user's install, which has none.

torch is in the test environment only for the transformers-oracle tests, which import it in
the pytest process. transformers 5 imports torch whenever it is importable (its rope
utilities, at ``import mlx_lm``), about 2.5 s of CPU per process on 2 cores, and no command
the subprocesses run (``qab``, the examples, the benchmarks) uses it. With ``torch`` set to
None in ``sys.modules``, ``importlib.util.find_spec("torch")`` is None and ``import torch``
raises ImportError, so transformers sees no torch. A subprocess that needs torch (llama.cpp's
converter) is started with a PYTHONPATH of its own.
"""

import sys

sys.modules.setdefault("torch", None)
