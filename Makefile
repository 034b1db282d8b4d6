# Two entry points (see README): `make demo` and `make test`. Both build .venv in the repo root.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU build of PyTorch by default; GPU users: make demo TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=
STORE ?= stores/sample
# processes for the full suite (pytest-xdist), each running whole test modules (--dist loadfile). On the
# 2-core VM two beat one (11 min 46 s against 19 min 16 s) and three (8 min 24 s against 9 min 00 s, the
# same hour); the fast tier gains nothing from them (82 s either way)
TEST_WORKERS ?= 2
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
# setuptools warns on every editable install that a folder named like the package may shadow it: that
# folder is the package itself here, so the warning says nothing to a user of this Makefile
PIP := PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip

# The suites start hundreds of Python processes. Where PYTHONDONTWRITEBYTECODE is set (as on our 2-core VM)
# nothing caches the repo's byte code, so each process would compile every module of ours it imports:
# compile them once before the tests.
COMPILE := $(BIN)/python -m compileall -q -j 0 medload tests pipelines benchmarks

.PHONY: demo test test-fast apt-deps clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	@# the core install (ingest, store, training input) and the viz extra that the README's next steps use
	@# (medload view, Store.catalog, the notebooks); other extras: docs/getting-started.md
	$(PIP) install --quiet -e ".[viz]"
	touch $@

$(BIN)/.dev-installed: $(BIN)/.installed pyproject.toml
	$(PIP) install --quiet -e ".[dev]" "$(TORCH_SPEC)"  # the torch above: nnunetv2 must not replace it
	@# nnunetv2 pulls torchvision (through timm); a build that does not match the installed torch fails to
	@# load and breaks MONAI's optional import of it. Nothing of ours needs torchvision: drop one that cannot load.
	@$(BIN)/python -c "import torchvision" 2>/dev/null || $(PIP) uninstall --quiet -y torchvision
	touch $@

# System packages the tests use: dcm2niix (reference converter, the geometry oracle); orthanc and
# orthanc-dicomweb (a real DICOMweb server: tests/pacs/test_dicomweb.py starts its own on loopback).
APT_PACKAGES := dcm2niix orthanc orthanc-dicomweb
apt-deps:
	@dpkg -s $(APT_PACKAGES) >/dev/null 2>&1 || { \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES) >/dev/null; }

demo: $(BIN)/.installed
	$(BIN)/medload ingest sample_data/philips_ct_head/dicom $(STORE)
	$(BIN)/medload info $(STORE)
	$(BIN)/python pipelines/train_segmentation.py --store $(STORE) --quick --demo-target bone --out runs/demo

test: $(BIN)/.dev-installed apt-deps
	$(BIN)/ruff check medload tests benchmarks sample_data pipelines notebooks  # ruff lints .ipynb cells natively
	$(BIN)/mypy  # the whole medload package (settings: pyproject.toml [tool.mypy])
	$(COMPILE)
	$(BIN)/pytest -q -n $(TEST_WORKERS) --dist loadfile --nbmake notebooks tests  # the notebooks too (nbmake)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir .site

# The quick tier while working: no apt packages, servers, Dask or torchrun, nothing marked slow (pyproject.toml)
test-fast: $(BIN)/.dev-installed
	$(COMPILE)
	$(BIN)/pytest -q -m "not (slow or dcm2niix or orthanc or dask or torchrun)"

clean:
	rm -rf stores runs .pytest_cache .hypothesis .site .mypy_cache
	find medload tests pipelines benchmarks -name __pycache__ -prune -exec rm -rf {} +
