# Two commands on a fresh machine:
#   make demo   - build the default model once and generate with fused vs stock
#   make test   - run the test suite
# Both use one virtual environment (.venv); each installs only what it needs and keeps
# its own stamp file, so `make demo` does not install the test tools, torch or llama.cpp
# (and after `make install` installs nothing).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# How make test builds llama-cpp-python (see the test install below).
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DGGML_LLAMAFILE=OFF -DCMAKE_C_FLAGS_RELEASE='-O1 -DNDEBUG' -DCMAKE_CXX_FLAGS_RELEASE='-O1 -DNDEBUG' '-DCMAKE_PROJECT_llama.cpp_INCLUDE=$(CURDIR)/plugins/qab-llamacpp/cmake/no-common.cmake'

.PHONY: demo test install clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip setuptools wheel

# The package alone (with MLX's CPU backend where there is no Metal): what `qab demo` needs.
$(VENV)/.demo-installed: pyproject.toml | $(PY)
	# After `make install` (its stamp newer than pyproject.toml) the package is there already.
	if [ ! $(VENV)/.test-installed -nt pyproject.toml ]; then $(PIP) install --quiet -e ".[cpu]"; fi
	touch $@

# The package, the test tools, and the best-effort extras some tests use.
$(VENV)/.test-installed: pyproject.toml | $(PY)
	# The llama.cpp plugin's dependencies (its tests install the plugin itself into a temporary
	# folder): llama-cpp-python has no binary wheel, so it is built from source once (a few
	# minutes on 2 cores) and the wheel kept in .whl/; the llama.cpp tests skip without it.
	# The build runs in the background while pip installs the package, the test tools and
	# torch, which mostly wait on downloads and disk; its log is .whl/build.log.
	# Portable, not -march=native (GGML_NATIVE=OFF), and never from pip's wheel cache: a
	# native wheel, cached or built on a machine whose CPU reported features its host then
	# refused, stopped the llama.cpp tests with "Illegal instruction". A build for the tests:
	# at -O1 and without llamafile's sgemm, 271 s instead of 363 s on 2 cores, and the
	# llama.cpp tests (tiny models) took as long on either (132 and 136 s); without
	# llama.cpp's `common` library, which the Python package never loads
	# (plugins/qab-llamacpp/cmake/no-common.cmake), 145 s instead of 283 s. Not for timing
	# llama.cpp: after removing .whl/ and the stamp,
	# `make install LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF"` builds its release flags.
	# The transformers oracle tests need the torch CPU build; they skip without it.
	@mkdir -p .whl
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) wheel --quiet --no-cache-dir --no-deps --find-links .whl -w .whl \
	  "llama-cpp-python==0.3.36" > .whl/build.log 2>&1 & llama=$$!; \
	$(PIP) install --quiet -e ".[test]" || { kill $$llama; exit 1; }; \
	$(PIP) install --quiet "torch==2.13.0" \
	  || echo "note: torch 2.13.0 not installable here; transformers-oracle tests will be skipped"; \
	if wait $$llama; then \
	  $(PIP) install --quiet --find-links .whl "llama-cpp-python==0.3.36" "gguf>=0.17" \
	    || echo "note: llama-cpp-python not installed here; llama.cpp plugin tests will be skipped"; \
	else \
	  tail -n 20 .whl/build.log; \
	  echo "note: llama-cpp-python not built here (.whl/build.log); llama.cpp plugin tests will be skipped"; \
	fi
	touch $@

install: $(VENV)/.test-installed

demo: $(VENV)/.demo-installed
	$(VENV)/bin/qab demo

# Two pytest workers (pytest-xdist): the suite is CPU-bound and the CI machine has
# two cores (a machine like it, 2026-12-07: about 17.5 min with two workers, after a 4.5 min install).
test: $(VENV)/.test-installed
	$(PY) -m pytest -q -ra -n 2

clean:
	rm -rf $(VENV) .pytest_cache
