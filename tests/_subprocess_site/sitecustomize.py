"""Run by every Python subprocess the tests start (conftest.py puts this folder first on
PYTHONPATH): hides torch from them, as from a user's install, which has none, and keeps
transformers' import structure in a file per test session.

torch is in the test environment only for the transformers-oracle tests, which import it in
the pytest process. transformers 5 imports torch whenever it is importable (its rope
utilities, at ``import mlx_lm``), about 2.5 s of CPU per process on 2 cores, and no command
the subprocesses run (``qab``, the examples, the benchmarks) uses it. With ``torch`` set to
None in ``sys.modules``, ``importlib.util.find_spec("torch")`` is None and ``import torch``
raises ImportError, so transformers sees no torch. A subprocess that needs torch (llama.cpp's
converter) is started with a PYTHONPATH of its own.

``import transformers`` (at ``import mlx_lm``) builds its lazy module table with
``transformers.utils.import_utils.define_import_structure``, which reads the source of each of
its ~3,400 model files for their ``__all__``: about 1.4 s of CPU per process here. Its result
depends only on the installed files, so with ``QAB_TEST_IMPORT_STRUCTURE_DIR`` set (conftest.py
sets it to a folder of the session) the first subprocess stores each result there (pickled)
and the others load it. Without the variable, or when the file cannot be read, transformers'
own function runs.
"""

import os
import sys

sys.modules.setdefault("torch", None)


def _cache_import_structure(folder: str) -> None:
    import functools
    import hashlib
    import importlib.abc
    import importlib.machinery
    import pickle

    name = "transformers.utils.import_utils"

    def wrap(module) -> None:
        compute = getattr(module, "define_import_structure", None)
        if compute is None:  # (another transformers: its own import, uncached)
            return

        @functools.lru_cache
        def define_import_structure(module_path, prefix=None):
            version = getattr(sys.modules.get("transformers"), "__version__", "")
            key = hashlib.sha256(repr((version, str(module_path), prefix)).encode()).hexdigest()
            path = os.path.join(folder, f"import-structure-{key[:24]}.pickle")
            try:
                with open(path, "rb") as f:
                    return pickle.load(f)
            except Exception:  # noqa: BLE001 - absent or unreadable: compute it
                pass
            value = compute(module_path, prefix)
            tmp = f"{path}.{os.getpid()}.tmp"
            try:
                with open(tmp, "wb") as f:
                    pickle.dump(value, f)
                os.replace(tmp, path)  # whole files only, for the other processes
            except OSError:
                pass
            return value

        define_import_structure.__doc__ = compute.__doc__
        module.define_import_structure = define_import_structure

    class Finder(importlib.abc.MetaPathFinder):
        """Finds ``transformers.utils.import_utils`` as the path finder does and replaces its
        ``define_import_structure`` right after the module runs, before any other transformers
        module imports the name."""

        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
            if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                wrap(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


if os.environ.get("QAB_TEST_IMPORT_STRUCTURE_DIR"):
    _cache_import_structure(os.environ["QAB_TEST_IMPORT_STRUCTURE_DIR"])
