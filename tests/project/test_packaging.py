"""Packaging: the core install and its extras, ``__version__`` and ``medload --version``, the SPDX licence,
``py.typed``; a missing extra's feature names the extra; the benchmark harness stays out of the library's
import graph. The slow test builds a real core-only virtual environment and trains from it."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import pytest
import tomllib

from medload.extras import EXTRAS

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
#: distribution names of the modules in medload.extras.EXTRAS
DISTRIBUTION = {"dask_jobqueue": "dask-jobqueue", "distributed": "dask"}
OPTIONAL = {m for modules in EXTRAS.values() for m in modules}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in requirements}


def _extra(name: str) -> set[str]:
    """Distribution names an extra installs, following ``medload[...]`` references."""
    out: set[str] = set()
    for req in PROJECT["optional-dependencies"][name]:
        inner = re.fullmatch(r"medload\[([\w,]+)\]", req)
        out |= set().union(*(_extra(n) for n in inner.group(1).split(","))) if inner else _names([req])
    return out


@pytest.fixture(scope="module")
def sample_store(tmp_path_factory) -> Path:
    from medload.ingest.run import ingest

    path = tmp_path_factory.mktemp("packaging") / "store"
    ingest(REPO / "sample_data" / "philips_ct_head" / "dicom", path)
    return path


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


def test_version_comes_from_the_installed_metadata_and_the_cli_prints_it():
    import medload

    assert medload.__version__ == importlib.metadata.version("medload") == PROJECT["version"]
    out = subprocess.run([sys.executable, "-m", "medload.cli", "--version"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"medload {medload.__version__}"


def test_licence_is_an_spdx_expression_with_its_text_and_the_package_is_typed():
    assert PROJECT["license"] == "Apache-2.0"
    assert "Apache License" in (REPO / "LICENSE").read_text()
    assert (REPO / "medload" / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["medload"]
    build = PYPROJECT["build-system"]["requires"][0]
    assert int(re.search(r">=(\d+)", build).group(1)) >= 77  # the first setuptools that reads an SPDX string


def test_core_dependencies_hold_no_optional_feature():
    core = _names(PROJECT["dependencies"])
    for modules in EXTRAS.values():
        for module in modules:
            assert DISTRIBUTION.get(module, module).lower() not in core, module


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_each_extra_installs_the_modules_medload_asks_it_for(extra):
    installs = _extra(extra)
    for module in EXTRAS[extra]:
        assert DISTRIBUTION.get(module, module).lower() in installs, (extra, module)


def test_all_holds_every_extra_but_nnunet_and_dev_holds_all():
    everything = set().union(*(_extra(e) for e in EXTRAS if e != "nnunet"))
    assert _extra("all") == everything
    assert _extra("all") | _extra("nnunet") <= _extra("dev")


def test_the_library_imports_without_any_optional_module():
    """``import medload``, the command line, ingest and the training input load none of the extras' modules
    (httpx is left out of the check: blosc2, a core dependency, imports it itself)."""
    out = _run("""
        import sys
        import medload, medload.cli.app, medload.data, medload.ingest, medload.storage.store, medload.viz
        print(" ".join(sorted(m for m in sys.argv[1:] if m in sys.modules or any(k.startswith(m + ".") for k in sys.modules))))
    """, *sorted(OPTIONAL - {"httpx"}), "medload.bench")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


# each feature, with the module its extra brings hidden (None in sys.modules makes its import fail)
FEATURES = [
    ("pynetdicom", "pacs", "import medload.pacs.dimse"),
    ("pynetdicom", "pacs", "from medload.writeback.pacs import connect; connect('dimse://PACS@127.0.0.1:1')"),
    ("httpx", "dicomweb", "import medload.pacs.dicomweb"),
    ("pandas", "viz", "medload.open_store(sys.argv[1]).catalog()"),
    ("matplotlib", "viz", "s = medload.open_store(sys.argv[1]); medload.viz.show_slice(s, s.series()[0].key, 0)"),
    ("distributed", "dask", "from medload.ingest.cluster import local_cluster\nwith local_cluster(1): pass"),
    ("lightning", "lightning", "import medload.lightning"),
    ("zarr", "bench", "import medload.bench.run"),
]


@pytest.mark.parametrize(("hidden", "extra", "code"), FEATURES, ids=[f"{f[1]}-{f[0]}" for f in FEATURES])
def test_a_feature_without_its_extra_names_the_extra(hidden, extra, code, sample_store):
    out = _run(f"""
        import sys
        import medload, medload.ingest  # blosc2, a core dependency, imports httpx itself: hide it after
        sys.modules[{hidden!r}] = None
        from medload.extras import MissingExtraError
        try:
{textwrap.indent(code, " " * 12)}
        except MissingExtraError as exc:
            print(exc)
    """, str(sample_store))
    assert out.returncode == 0, out.stderr
    # this test environment is a source install, as make demo's: the command installs from the checkout
    assert f"{sys.executable} -m pip install -e '{REPO}[{extra}]'" in out.stdout and hidden in out.stdout


def test_the_command_line_says_which_extra_in_one_line(sample_store, tmp_path):
    out = _run("""
        import sys
        sys.modules["matplotlib"] = None
        from medload.cli import main
        sys.argv = ["medload", "view", *sys.argv[1:]]
        main()
    """, str(sample_store), "0", "-o", str(tmp_path / "x.png"))
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"pip install -e '{REPO}[viz]'" in lines[0], out.stderr


@pytest.mark.slow
def test_a_core_only_install_ingests_and_trains(tmp_path):
    """A fresh virtual environment with the core install alone (torch pinned as the Makefile does): ingest
    the sample, read a training batch, and find every extra's module absent and named when asked for."""
    env_dir = tmp_path / "core"
    venv.EnvBuilder(with_pip=False).create(env_dir)  # this pip installs into it (--python): no pip of its own
    python = env_dir / "bin" / "python"
    quiet = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONWARNINGS": "ignore"}
    pip = [sys.executable, "-m", "pip"]
    wheel = subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "--wheel-dir", str(tmp_path / "wheel"), str(REPO)],
                           capture_output=True, text=True, env=quiet, timeout=600)
    assert wheel.returncode == 0, wheel.stderr[-3000:]
    (built,) = (tmp_path / "wheel").glob("medload-*.whl")
    done = subprocess.run([*pip, "--python", str(python), "install", "--quiet", "--no-compile", "torch==2.13.0",
                           str(built)], capture_output=True, text=True, env=quiet, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    check = subprocess.run([str(python), str(REPO / "tests" / "helpers" / "core_install_check.py"), str(tmp_path / "store"),
                            *sorted(OPTIONAL - {"httpx"})], capture_output=True, text=True, cwd=tmp_path,
                           timeout=600)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "core install ok" in check.stdout
